"""The engine's recent prefill rate: the prompt tokens per second a queued prefill gets.

Each step that computed prefill tokens adds every token it computed (prefill and decode rows:
on a CPU a decode row costs about what a prompt token does in the dense layers, which dominate)
and its duration to two exponentially decayed sums; their ratio is the step's token rate. A
queued prompt gets the step's budget less one row per running decode, so the prefill rate is
that rate times the prefill share of the budget. Counting only the prefill tokens of mixed
steps made the rate read what a step's few prefill tokens got beside many decodes: after a
rolling restart a worker read 60 tokens/s (about five times too slow) and refused 40 requests
at once that it would have started within the target.

The rate is the median of the last steps' rates, so one step stalled by something else on the
machine (another service loading its model on the same cores) does not make the worker refuse
the next burst: with a decayed average, the decode workers restarted in a rolling drill read 45-55
tokens/s afterwards (the engine alone computes about 470 a second on one thread here) and
refused a burst of 40 short requests.
The first steps with prefill work are not measured at all: they pay for the warm-up
(allocations, kernel selection, compiles), seconds on a CPU, which would make a fresh worker look
ten times slower than it is.
"""

from __future__ import annotations

import statistics
from collections import deque

MIN_PREFILL_SHARE = 0.125  # of a step's budget, however many decodes run (the scheduler's chunks get at least this)


class PrefillRate:
    def __init__(self, num_steps: int = 9, num_warmup_steps: int = 1) -> None:
        if num_steps < 1 or num_warmup_steps < 0:
            raise ValueError(f"num_steps must be >= 1 and num_warmup_steps >= 0, got {num_steps}, {num_warmup_steps}")
        self._num_warmup_steps_left = num_warmup_steps
        self._rates: deque[float] = deque(maxlen=num_steps)

    def add_step(self, num_prefill_tokens: int, step_time_s: float, num_decode_tokens: int = 0) -> None:
        """One step's work; a step without prefill tokens (or without measurable time) says nothing."""
        if num_prefill_tokens < 1 or step_time_s <= 0.0:
            return
        if self._num_warmup_steps_left:
            self._num_warmup_steps_left -= 1
            return
        self._rates.append((num_prefill_tokens + num_decode_tokens) / step_time_s)

    @property
    def tokens_per_s(self) -> float:
        """Tokens computed per second of the recent steps that prefilled (their median); 0 until one was measured."""
        return statistics.median(self._rates) if self._rates else 0.0

    def prefill_tokens_per_s(self, step_budget: int, num_decodes: int) -> float:
        """The prompt tokens per second a queued prefill gets while `num_decodes` sequences decode
        in each step of `step_budget` tokens; 0 until measured."""
        share = max(step_budget - num_decodes, MIN_PREFILL_SHARE * step_budget) / step_budget
        return self.tokens_per_s * share
