"""The engine's recent prefill rate: the prompt tokens per second a queued prefill gets.

A step's time is about a fixed cost plus a cost per row it computes (prefill tokens and decode
rows alike: on a CPU the dense layers dominate, and a row costs about the same in either). The
two are fitted to the last steps' (rows, seconds) by Theil-Sen: the slope is the median of the
pairwise slopes and the fixed cost the median of what is left, so a step stalled by another
process on the same cores moves neither. A queued prompt is computed in full steps, of the
budget less one row per running decode, so its rate is that share of the budget over a full
step's time.

Counting only a mixed step's prefill tokens over its whole time (what this measured before)
read what a step's few prefill tokens got beside its decodes, and small steps pay the fixed cost
for few rows: after a rolling restart the decode workers read 45-78 tokens/s (the engine alone
computes about 470 a second on one thread here) and refused a burst of 40 short requests that
the same stack starts within two seconds.

The first steps are not measured at all: they pay for the warm-up (allocations, kernel
selection, compiles), seconds on a CPU, which would make a fresh worker look ten times slower
than it is. Until a step that prefilled has been measured the rate is 0 (unknown).
"""

from __future__ import annotations

import statistics
from collections import deque

MIN_PREFILL_SHARE = 0.125  # of a step's budget, however many decodes run (the scheduler's chunks get at least this)
MIN_ROWS_SPREAD = 2.0  # the fit needs steps this many times larger than others; else the cost is per row alone


class PrefillRate:
    def __init__(self, num_steps: int = 32, num_warmup_steps: int = 1) -> None:
        if num_steps < 2 or num_warmup_steps < 0:
            raise ValueError(f"num_steps must be >= 2 and num_warmup_steps >= 0, got {num_steps}, {num_warmup_steps}")
        self._num_warmup_steps_left = num_warmup_steps
        self._steps: deque[tuple[int, float]] = deque(maxlen=num_steps)
        self._has_prefilled = False

    def add_step(self, num_prefill_tokens: int, step_time_s: float, num_decode_tokens: int = 0) -> None:
        """One step's rows and time; a step of no rows (or without measurable time) says nothing."""
        num_rows = num_prefill_tokens + num_decode_tokens
        if num_rows < 1 or step_time_s <= 0.0:
            return
        if self._num_warmup_steps_left:
            if num_prefill_tokens:  # the warm-up is the first prefill's (decode-only steps come after one)
                self._num_warmup_steps_left -= 1
            return
        self._has_prefilled = self._has_prefilled or num_prefill_tokens > 0
        self._steps.append((num_rows, step_time_s))

    def step_cost(self) -> tuple[float, float]:
        """(fixed seconds, seconds per row) of a step; (0, 0) until measured."""
        if not self._has_prefilled:
            return 0.0, 0.0
        rows = [r for r, _ in self._steps]
        if max(rows) < MIN_ROWS_SPREAD * min(rows):
            return 0.0, statistics.median(t / r for r, t in self._steps)
        steps = list(self._steps)
        slopes = [(t2 - t1) / (r2 - r1) for i, (r1, t1) in enumerate(steps) for r2, t2 in steps[i + 1 :] if r2 != r1]
        per_row = statistics.median(slopes)
        if per_row <= 0.0:  # noise beyond the spread: no slope to trust
            return 0.0, statistics.median(t / r for r, t in self._steps)
        fixed = max(0.0, statistics.median(t - per_row * r for r, t in steps))
        return fixed, per_row

    def prefill_tokens_per_s(self, step_budget: int, num_decodes: int) -> float:
        """The prompt tokens per second a queued prefill gets while `num_decodes` sequences decode
        in each step of `step_budget` rows; 0 until measured."""
        fixed, per_row = self.step_cost()
        if per_row <= 0.0:
            return 0.0
        share = max(step_budget - num_decodes, MIN_PREFILL_SHARE * step_budget)
        return share / (fixed + per_row * step_budget)
