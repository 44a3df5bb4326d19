"""A step's token budget: how many tokens the step may still give a sequence of a lane.

`max_num_batched_tokens` bounds a step's decodes and prefill chunks together. Free and
background sequences share a cap of their own, the unpaid cap, fixed when the step is planned
by what paid work is doing:

- a paid sequence waits: 0. The step is the paid admission's (plus the paid work that runs),
  so the paid request starts now.
- paid work runs: `max_num_unpaid_tokens`, so each step stays short and a paid request that
  arrives during one starts soon. Paid rows are bounded only by the step budget.
- no paid work runs or waits: no cap of their own. Idle capacity is theirs, and a paid arrival
  cuts their step short (the engine's cut_step, EngineConfig.cut_unpaid_steps).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.sequence import Lane, Sequence
from tandem.engine.step_plan import StepPlan


@dataclass(frozen=True)
class StepBudget:
    max_num_tokens: int  # decodes and prefill chunks together
    unpaid_cap: int | None  # free and background tokens together; None: only max_num_tokens bounds them

    @classmethod
    def for_step(
        cls, max_num_tokens: int, max_num_unpaid_tokens: int | None, *, is_paid_waiting: bool, is_paid_running: bool
    ) -> StepBudget:
        if is_paid_waiting:
            return cls(max_num_tokens, 0)
        if is_paid_running:
            return cls(max_num_tokens, max_num_unpaid_tokens)
        return cls(max_num_tokens, None)

    def left(self, plan: StepPlan, lane: Lane) -> int:
        """The tokens `plan` can still give a sequence of `lane`."""
        budget = self.max_num_tokens - plan.num_prefill_tokens - plan.num_decode_tokens
        if lane is Lane.PAID or self.unpaid_cap is None:
            return budget
        return max(0, min(budget, self.unpaid_cap - plan.num_unpaid_tokens))


def max_chunk(seq: Sequence, max_replayed_tokens: int) -> int:
    """The sequence's uncomputed tokens, of them at most `max_replayed_tokens` generated ones: a
    recomputed generated token is computed as a decode over its whole context, so a long replay
    would stall the step's other sequences."""
    num_prompt_left = max(seq.num_prompt_tokens - seq.num_computed_tokens, 0)
    return min(seq.num_uncomputed_tokens, num_prompt_left + max_replayed_tokens)
