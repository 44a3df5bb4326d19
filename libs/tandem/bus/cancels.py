"""Replies cancelled lately. A cancel can overtake the assignment it is meant for (they travel
from different publishers), so routers and workers remember cancels for a while and refuse to
start a reply that was already cancelled."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

REMEMBER_S = 120.0


class RecentCancels:
    def __init__(self, remember_s: float = REMEMBER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._remember_s = remember_s
        self._clock = clock
        self._at_s: OrderedDict[str, float] = OrderedDict()

    def note(self, reply_id: str) -> None:
        now_s = self._clock()
        self._at_s[reply_id] = now_s
        self._at_s.move_to_end(reply_id)
        while self._at_s and next(iter(self._at_s.values())) < now_s - self._remember_s:
            self._at_s.popitem(last=False)

    def __contains__(self, reply_id: object) -> bool:
        at_s = self._at_s.get(reply_id) if isinstance(reply_id, str) else None
        return at_s is not None and at_s >= self._clock() - self._remember_s
