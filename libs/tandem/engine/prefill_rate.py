"""The engine's recent prefill rate: the prompt tokens per second a queued prefill gets.

Each step that computed prefill tokens adds every token it computed (prefill and decode rows:
on a CPU a decode row costs about what a prompt token does in the dense layers, which dominate)
and its duration to two exponentially decayed sums; their ratio is the step's token rate. A
queued prompt gets the step's budget less one row per running decode, so the prefill rate is
that rate times the prefill share of the budget. Counting only the prefill tokens of mixed
steps made the rate read what a step's few prefill tokens got beside many decodes: after a
rolling restart a worker read 60 tokens/s (about five times too slow) and refused 40 requests
at once that it would have started within the target.

Weighting by tokens keeps a few tiny chunks (a continuation's last tokens) from dragging the
rate down. The first steps with prefill work are not measured at all: they pay for the warm-up
(allocations, kernel selection, compiles), seconds on a CPU, which would make a fresh worker look
ten times slower than it is.
"""

from __future__ import annotations

MIN_PREFILL_SHARE = 0.125  # of a step's budget, however many decodes run (the scheduler's chunks get at least this)


class PrefillRate:
    def __init__(self, decay: float = 0.8, num_warmup_steps: int = 1) -> None:
        if not 0.0 < decay < 1.0 or num_warmup_steps < 0:
            raise ValueError(f"decay must be in (0, 1) and num_warmup_steps >= 0, got {decay}, {num_warmup_steps}")
        self._decay = decay
        self._num_warmup_steps_left = num_warmup_steps
        self._num_tokens = 0.0
        self._time_s = 0.0

    def add_step(self, num_prefill_tokens: int, step_time_s: float, num_decode_tokens: int = 0) -> None:
        """One step's work; a step without prefill tokens (or without measurable time) says nothing."""
        if num_prefill_tokens < 1 or step_time_s <= 0.0:
            return
        if self._num_warmup_steps_left:
            self._num_warmup_steps_left -= 1
            return
        self._num_tokens = self._decay * self._num_tokens + num_prefill_tokens + num_decode_tokens
        self._time_s = self._decay * self._time_s + step_time_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens computed per second of the steps that prefilled; 0 until one was measured."""
        return self._num_tokens / self._time_s if self._time_s > 0.0 else 0.0

    def prefill_tokens_per_s(self, step_budget: int, num_decodes: int) -> float:
        """The prompt tokens per second a queued prefill gets while `num_decodes` sequences decode
        in each step of `step_budget` tokens; 0 until measured."""
        share = max(step_budget - num_decodes, MIN_PREFILL_SHARE * step_budget) / step_budget
        return self.tokens_per_s * share
