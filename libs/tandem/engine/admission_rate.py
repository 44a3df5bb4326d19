"""How fast the engine's queue drains, by lane: requests of a lane admitted per second of the
steps after which some of that lane still waited.

A queue of requests is admitted as fast as running ones make room (their KV blocks, seats, a
step's rows), which is neither the prefill rate nor anything a request's own size says: with KV
full of decoding replies, 40 queued 50-token prompts wait for 40 replies to end, seconds each,
while their prompt tokens alone would be computed in two. Little's law gives their wait from
this rate: the requests ahead over the requests admitted per second. It is per lane because the
lanes drain at different rates: paid work goes first, so a free request waits for the free lane's
own share of the room, not for the fleet's.

Only steps that ended with requests of the lane still waiting are measured for it: in the others
its queue ran dry, so arrivals, not room, limited its admissions. The rate is over such steps
that ended in the last `window_s` seconds, together (admitted / their time): recent enough to
follow a burst that fills the engine within seconds, and forgetting a queue long gone (a rate
measured in another load would misjudge this one); a step that admitted nobody counts as time
the queue did not move. When none of them admitted anybody, one admission is assumed (the rate
is at most that), so a stuck queue reads as slow, never as infinitely so. None while no step of
the window was measured.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping

from tandem.engine.sequence import Lane


class AdmissionRate:
    def __init__(self, window_s: float = 4.0) -> None:
        if window_s <= 0.0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._steps: dict[Lane, deque[tuple[float, int, float]]] = {lane: deque() for lane in Lane}  # (ended, admitted, seconds)

    def add_step(self, num_admitted: Mapping[Lane, int], step_time_s: float, waiting_lanes: Collection[Lane], now_s: float) -> None:
        """One step that ended at `now_s` (monotonic seconds): `num_admitted` by lane, measured for
        each lane still waiting after it."""
        if step_time_s <= 0.0:
            return
        for lane in waiting_lanes:
            self._steps[lane].append((now_s, num_admitted.get(lane, 0), step_time_s))
        for steps in self._steps.values():
            while steps and steps[0][0] < now_s - self._window_s:
                steps.popleft()

    def per_s(self, lane: Lane, now_s: float) -> float | None:
        """Requests of `lane` admitted per second while some of it waited, over the window ending
        at `now_s`; None when no step of it was measured."""
        steps = [(n, s) for ended, n, s in self._steps[lane] if ended >= now_s - self._window_s]
        if not steps:
            return None
        return max(1, sum(n for n, _ in steps)) / sum(s for _, s in steps)
