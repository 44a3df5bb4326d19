"""The engine's recent prefill rate, in tokens per second of step time.

Each step that computed prefill tokens adds its prefill token count and its whole duration
(decodes share the step, so the rate is what prefill gets in practice) to two exponentially
decayed sums; the rate is their ratio. Weighting by tokens keeps a few tiny chunks (a
continuation's last tokens) from dragging the rate down. The first steps with prefill work are
not measured at all: they pay for the warm-up (allocations, kernel selection, compiles), seconds
on a CPU, which would make a fresh worker look ten times slower than it is.
"""

from __future__ import annotations


class PrefillRate:
    def __init__(self, decay: float = 0.8, num_warmup_steps: int = 1) -> None:
        if not 0.0 < decay < 1.0 or num_warmup_steps < 0:
            raise ValueError(f"decay must be in (0, 1) and num_warmup_steps >= 0, got {decay}, {num_warmup_steps}")
        self._decay = decay
        self._num_warmup_steps_left = num_warmup_steps
        self._num_tokens = 0.0
        self._time_s = 0.0

    def add_step(self, num_prefill_tokens: int, step_time_s: float) -> None:
        """One step's work; a step without prefill tokens (or without measurable time) says nothing."""
        if num_prefill_tokens < 1 or step_time_s <= 0.0:
            return
        if self._num_warmup_steps_left:
            self._num_warmup_steps_left -= 1
            return
        self._num_tokens = self._decay * self._num_tokens + num_prefill_tokens
        self._time_s = self._decay * self._time_s + step_time_s

    @property
    def tokens_per_s(self) -> float:
        """0 until a step with prefill work was measured."""
        return self._num_tokens / self._time_s if self._time_s > 0.0 else 0.0
