"""A model-free runner: it "computes" KV by writing token ids into a fake cache, slot by slot.

Every step it checks that each scheduled sequence's whole context (prefix hits included) reads
back its own token ids through its block table, so a block shared wrongly, reused while cached
content was still needed, or recomputed into the wrong place fails the test that ran it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tandem.engine.kv_cache_manager import KvCacheManager
from tandem.engine.scheduler import Scheduler, SchedulerConfig, StepPlan, UpdateResult
from tandem.engine.sequence import Sequence


def next_token_of_position(seq: Sequence) -> int:
    """A deterministic 'model': the next token depends only on the sequence's length."""
    return 1000 + seq.num_tokens


class FakeRunner:
    def __init__(self, kv: KvCacheManager, next_token: Callable[[Sequence], int] = next_token_of_position) -> None:
        self.block_size = kv.block_size
        self.kv_tokens: list[int | None] = [None] * (kv.num_blocks * kv.block_size)
        self.next_token = next_token

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: StepPlan) -> dict[str, int]:
        for chunk in plan.scheduled:
            seq = chunk.seq
            assert chunk.num_computed_tokens == seq.num_computed_tokens
            assert len(seq.block_table) * self.block_size >= chunk.num_context_tokens, "blocks do not cover the chunk"
            for position in range(chunk.num_computed_tokens, chunk.num_context_tokens):
                self.kv_tokens[self.slot(seq, position)] = seq.token_ids[position]
        for chunk in plan.scheduled:  # after all writes: nobody overwrote anybody's context
            seq = chunk.seq
            context = [self.kv_tokens[self.slot(seq, p)] for p in range(chunk.num_context_tokens)]
            assert context == seq.token_ids[: chunk.num_context_tokens], f"{seq.seq_id}: KV content is wrong"
        return {seq.seq_id: self.next_token(seq) for seq in plan.sampled_seqs}


class Engine:
    """Scheduler + fake runner, stepping the way the real engine loop does."""

    def __init__(self, num_blocks: int, config: SchedulerConfig, block_size: int = 16) -> None:
        self.kv = KvCacheManager(num_blocks, block_size)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = FakeRunner(self.kv)

    def step(self) -> tuple[StepPlan, UpdateResult]:
        plan = self.scheduler.schedule()
        return plan, self.scheduler.update(plan, self.runner.execute(plan))

    def run_until_idle(self, max_steps: int = 10_000) -> list[StepPlan]:
        plans = []
        while self.scheduler.has_work():
            assert len(plans) < max_steps, "the scheduler stopped making progress"
            plans.append(self.step()[0])
        return plans


@pytest.fixture
def make_engine() -> Callable[..., Engine]:
    def make(num_blocks: int = 64, block_size: int = 16, **config: int) -> Engine:
        return Engine(num_blocks, SchedulerConfig(**config), block_size)

    return make
