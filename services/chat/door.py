"""Free messages refused at the door while the routers refuse their lane.

A router that refuses a free reply for want of capacity (`overloaded`: every worker's queue would
make it wait past the lane's target, or the ladder's top rung) says when to retry. For a short
while after (the retry time, at most `max_closed_s`), this instance refuses the same model's free
messages at once, with 503 `overloaded` and the time left to the router's retry time, before it
reserves quota, stores or asks a router anything (services.chat.replies.ReplyStarter, the one
place a reply starts); while every served model's door is closed, as the message arrives, before
its input check, store reads, routing classifier or tokenizer too.
Under an overload that is most of what arrives, and all of it shares the cores with the replies
being served. Paid messages always go to the router: their lane is never closed here."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from services.chat import metrics
from services.chat.errors import Unavailable
from tandem.config import Tier

OVERLOADED = "overloaded"
MAX_CLOSED_S = 2.0


class Door:
    def __init__(self, max_closed_s: float = MAX_CLOSED_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_closed_s = max_closed_s
        self._clock = clock
        self._closed: dict[str, tuple[float, float, str]] = {}  # model -> (closed until, retry at, message)

    def refused(self, model: str, tier: Tier, code: str, retry_after_s: float, message: str) -> None:
        """A router refused a reply of `model` for a user of `tier` with `code`."""
        if tier == Tier.FREE and code == OVERLOADED and retry_after_s > 0:
            now = self._clock()
            self._closed[model] = (now + min(retry_after_s, self.max_closed_s), now + retry_after_s, message)

    def check_all(self, tier: Tier, models: Callable[[], Iterable[str]]) -> None:
        """Raises Unavailable (overloaded) for a free message while the door of every model
        `models()` names (those it could be routed to) is closed: checked as a request arrives,
        before its input check, the store or the routing classifier do any work for it."""
        if tier != Tier.FREE or not self._closed:
            return
        names = list(models())
        if not names:
            return
        for model in names:
            if model not in self._closed or self._clock() >= self._closed[model][0]:
                return
        self.check(min(names, key=lambda model: self._closed[model][1]), tier)  # the soonest retry

    def check(self, model: str, tier: Tier) -> None:
        """Raises Unavailable (overloaded) for a free message of `model` while its door is closed."""
        if tier != Tier.FREE or model not in self._closed:
            return
        until, retry_at, message = self._closed[model]
        now = self._clock()
        if now >= until:
            del self._closed[model]
            return
        metrics.REPLIES_REFUSED.labels(code=OVERLOADED).inc()
        raise Unavailable(f"{message} (refused at the door)", code=OVERLOADED, retry_after_s=max(retry_at - now, 0.1))
