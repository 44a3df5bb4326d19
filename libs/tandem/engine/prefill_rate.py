"""The engine's recent prefill rate: the prompt tokens per second a queued prefill gets.

A queue of prompts is computed in full steps (the step budget, less one row per running decode),
so the rate is measured on large steps only: those of at least a quarter of the budget, rows of
prefill and decode together (on a CPU a decode row costs about what a prompt token does in the
dense layers, which dominate). The rate is the median of the last such steps' rows per second,
times the share of the budget a prompt gets beside the running decodes; the median, so that one
step stalled by another process on the same cores moves nothing.

Small steps say nothing about it: each pays a fixed cost (Python, one kernel launch per layer
and op) for few rows. Rating every prefilling step by its prefill tokens over its whole time
(what this measured before) read a small fraction of what the engine computes in full steps, and
workers refused bursts they would have started soon after; a line fitted to small steps and
extrapolated to the budget read lower still.

Until a large step has been measured the rate is 0 (unknown), and admission does not refuse on
wait (tandem.worker.admission). The first prefilling step is not measured at all: it pays for
the warm-up (allocations, kernel selection, compiles), seconds on a CPU.
"""

from __future__ import annotations

import statistics
from collections import deque

MIN_PREFILL_SHARE = 0.125  # of a step's budget, however many decodes run (the scheduler's chunks get at least this)
LARGE_STEP_SHARE = 0.25  # a step of at least this share of the budget is measured


class PrefillRate:
    def __init__(self, step_budget: int, num_steps: int = 9, num_warmup_steps: int = 1) -> None:
        if step_budget < 1 or num_steps < 1 or num_warmup_steps < 0:
            raise ValueError(
                f"step_budget and num_steps must be >= 1, num_warmup_steps >= 0; got {step_budget}, {num_steps}, {num_warmup_steps}"
            )
        self._step_budget = step_budget
        self._min_rows = max(1, int(LARGE_STEP_SHARE * step_budget))
        self._num_warmup_steps_left = num_warmup_steps
        self._rates: deque[float] = deque(maxlen=num_steps)

    def add_step(self, num_prefill_tokens: int, step_time_s: float, num_decode_tokens: int = 0) -> None:
        """One step's work: measured if it prefilled and computed at least a quarter of the budget."""
        if num_prefill_tokens < 1 or step_time_s <= 0.0:
            return
        if self._num_warmup_steps_left:
            self._num_warmup_steps_left -= 1
            return
        num_rows = num_prefill_tokens + num_decode_tokens
        if num_rows >= self._min_rows:
            self._rates.append(num_rows / step_time_s)

    @property
    def rows_per_s(self) -> float:
        """Rows a large step computes per second (the recent median); 0 until one was measured."""
        return statistics.median(self._rates) if self._rates else 0.0

    def prefill_tokens_per_s(self, num_decodes: int) -> float:
        """The prompt tokens per second a queued prefill gets while `num_decodes` sequences decode
        in each step; 0 until measured."""
        share = max(self._step_budget - num_decodes, MIN_PREFILL_SHARE * self._step_budget) / self._step_budget
        return self.rows_per_s * share
