"""How fast the engine's queue drains: sequences admitted per second of the steps after which
some still waited.

A queue of requests is admitted as fast as running ones make room (their KV blocks, seats, a
step's rows), which is neither the prefill rate nor anything a request's own size says: with KV
full of decoding replies, 40 queued 50-token prompts wait for 40 replies to end, seconds each,
while their prompt tokens alone would be computed in two. Little's law gives their wait from
this rate: the sequences ahead over the sequences admitted per second.

Only steps that ended with sequences still waiting are measured: in the others the queue ran
dry, so admissions were limited by arrivals, not by room. The rate is over the last such steps
together (admitted / their time), so a step that admitted nobody counts as time the queue did
not move; when none of them admitted anybody, one admission is assumed (the rate is at most
that), so a stuck queue reads as slow, never as infinitely so. None until a step was measured.
"""

from __future__ import annotations

from collections import deque


class AdmissionRate:
    def __init__(self, num_steps: int = 64) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._steps: deque[tuple[int, float]] = deque(maxlen=num_steps)  # (admitted, seconds)

    def add_step(self, num_admitted: int, step_time_s: float, is_queue_left: bool) -> None:
        """One step: measured when sequences still waited after its admissions."""
        if is_queue_left and step_time_s > 0.0:
            self._steps.append((num_admitted, step_time_s))

    @property
    def per_s(self) -> float | None:
        """Sequences admitted per second while the queue was not empty; None until measured."""
        if not self._steps:
            return None
        return max(1, sum(n for n, _ in self._steps)) / sum(s for _, s in self._steps)
