"""The overload ladder: how far free traffic is degraded, from the fleet's busyness.

Busyness is the busy share of the large model's decode pool, the max of
- KV occupancy: 1 - free KV blocks / all KV blocks, summed over the pool's live workers, and
- queue-wait pressure: the MEAN over the pool of each worker's expected wait for a free request
  (its heartbeat's `estimated_wait_s`) divided by the free lane's TTFT target, each capped at 1.
  The mean, not the max: placement sends new work to the least loaded workers, so one slow worker
  does not make the pool busy.

The ladder is observed every `interval_s` and moves at most one rung per observation, so a jump
to 100 % climbs over three observations. It climbs to rung 1, 2, 3 at 85 %, 92 %, 97 % and comes
down a rung only when busyness is `hysteresis` (7 points) below the line it went up at.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.router.workers import LiveWorker
from tandem import model_ids

RUNG_LINES = (0.85, 0.92, 0.97)  # busyness at which rung 1, 2, 3 is reached
HYSTERESIS = 0.07
# An observation this much of an interval early still counts (a timer may wake a little early).
_EARLY_SHARE = 0.05
_FLOAT_EPSILON = 1e-9


@dataclass(frozen=True)
class FleetReading:
    kv_occupancy: float = 0.0
    queue_pressure: float = 0.0

    @property
    def busyness(self) -> float:
        return max(self.kv_occupancy, self.queue_pressure)


def read_fleet(workers: Sequence[LiveWorker], model: str, free_target_s: float) -> FleetReading:
    """The busyness of `model`'s pool (every version of its name) among `workers` (live decode
    workers); an empty pool reads 0."""
    name = model_ids.name_of(model)
    pool = [w.heartbeat for w in workers if model_ids.name_of(w.model) == name and w.heartbeat.service.is_ready]
    if not pool:
        return FleetReading()
    num_blocks = sum(h.kv_blocks_total for h in pool)
    kv_occupancy = 1.0 - sum(h.kv_blocks_free for h in pool) / num_blocks if num_blocks else 0.0
    # each worker's wait against the target it states (scaled for its device), else `free_target_s`
    pressures = [min(1.0, max(0.0, h.estimated_wait_s) / (h.free_ttft_target_s or free_target_s)) for h in pool]
    return FleetReading(kv_occupancy=min(1.0, max(0.0, kv_occupancy)), queue_pressure=sum(pressures) / len(pressures))


class Ladder:
    """The rung, moved by `observe` at most once per `interval_s` (by `clock`) and one rung at a time."""

    def __init__(
        self,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        lines: Sequence[float] = RUNG_LINES,
        hysteresis: float = HYSTERESIS,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._lines = tuple(lines)
        self._hysteresis = hysteresis
        self._rung = 0
        self._last_at_s: float | None = None
        self.reading = FleetReading()  # the last one observed

    @property
    def rung(self) -> int:
        return self._rung

    @property
    def top_rung(self) -> int:
        return len(self._lines)

    def seconds_until_due(self) -> float:
        if self._last_at_s is None:
            return 0.0
        return max(0.0, self._last_at_s + self.interval_s - self._clock())

    def observe(self, reading: FleetReading) -> bool:
        """Takes `reading` as this interval's observation and moves at most one rung; False (and
        nothing moves) when the interval since the last observation has not passed."""
        now_s = self._clock()
        if self._last_at_s is not None and now_s - self._last_at_s < self.interval_s * (1 - _EARLY_SHARE):
            return False
        self._last_at_s = now_s
        self.reading = reading
        busyness = reading.busyness
        if self._rung < self.top_rung and busyness >= self._lines[self._rung] - _FLOAT_EPSILON:
            self._rung += 1
        elif self._rung > 0 and busyness <= self._lines[self._rung - 1] - self._hysteresis + _FLOAT_EPSILON:
            self._rung -= 1
        return True
