"""How many SSE streams this instance holds open, and each user: a new stream past the instance's
capacity is refused with 503 (`streams_full`), one past the user's tier limit with 429
(`too_many_streams`), both with Retry-After, before the response starts (so they are real HTTP
statuses) and before any reply is begun. A slot is held until the stream ends, for any reason.
An OpenAI completion takes one whether streamed or not (a whole answer holds its reply as long as
a stream does), until its answer has been sent.

Routes take a slot as a dependency (services.chat.deps.StreamAdmission): FastAPI resolves it
before the route runs and releases it after the response has been sent, or when the route raises."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from services.chat import metrics
from services.chat.errors import RateLimited, Unavailable
from tandem.config import ApiKey, Tier

RETRY_AFTER_S = 2.0


class StreamSlot:
    """One open stream's place; `release` is idempotent."""

    def __init__(self, slots: StreamSlots, user_id: str) -> None:
        self._slots = slots
        self.user_id = user_id
        self.is_released = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self._slots.release(self)


class StreamSlots:
    def __init__(self, max_streams: int, limit_of_tier: Mapping[Tier, int]) -> None:
        self.max_streams = max_streams
        self._limit_of_tier = dict(limit_of_tier)
        self._num_of_user: Counter[str] = Counter()
        self.num_open = 0

    def num_open_of(self, user_id: str) -> int:
        return self._num_of_user[user_id]

    def admit(self, user: ApiKey) -> StreamSlot:
        """A slot for a new stream of `user`; raises Unavailable or RateLimited past a limit."""
        if self.num_open >= self.max_streams:
            metrics.STREAMS_REFUSED.labels("streams_full").inc()
            raise Unavailable(
                f"this instance holds its {self.max_streams} streams; retry shortly", code="streams_full", retry_after_s=RETRY_AFTER_S
            )
        limit = self._limit_of_tier[user.tier]
        if self._num_of_user[user.user_id] >= limit:
            metrics.STREAMS_REFUSED.labels("too_many_streams").inc()
            raise RateLimited(
                f"{limit} streams are open for this key already (the {user.tier.value} tier's limit); close one or retry later",
                code="too_many_streams",
                retry_after_s=RETRY_AFTER_S,
            )
        self._num_of_user[user.user_id] += 1
        self.num_open += 1
        metrics.STREAMS_OPEN.set(self.num_open)
        return StreamSlot(self, user.user_id)

    def release(self, slot: StreamSlot) -> None:
        self._num_of_user[slot.user_id] -= 1
        if self._num_of_user[slot.user_id] <= 0:
            del self._num_of_user[slot.user_id]
        self.num_open -= 1
        metrics.STREAMS_OPEN.set(self.num_open)
