"""Failed API keys counted per client address: past `max_failures` in `window_s`, the address is
refused (429 with Retry-After) until its oldest failure leaves the window, so guessing keys from
one address goes at that rate. The counts live in this process: with several chat instances, an
address gets `max_failures` at each."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ThrottleConfig:
    max_failures: int = 10
    window_s: float = 60.0
    max_addresses: int = 100_000  # the addresses remembered at once; a flood of new ones evicts the oldest


class FailedKeyThrottle:
    def __init__(self, config: ThrottleConfig = ThrottleConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._failures_s: dict[str, deque[float]] = {}

    def retry_after_s(self, address: str) -> float:
        """How long `address` must wait before its next key is looked at; 0 when it need not."""
        failures_s = self._failures_s.get(address)
        if failures_s is None or len(failures_s) < self._config.max_failures:
            return 0.0
        return max(0.0, failures_s[0] + self._config.window_s - self._clock())

    def record_failure(self, address: str) -> None:
        now_s = self._clock()
        failures_s = self._failures_s.pop(address, None) or deque(maxlen=self._config.max_failures)
        while failures_s and failures_s[0] <= now_s - self._config.window_s:
            failures_s.popleft()
        failures_s.append(now_s)
        self._failures_s[address] = failures_s  # last in the dict's order: the most recent
        if len(self._failures_s) > self._config.max_addresses:
            del self._failures_s[next(iter(self._failures_s))]
