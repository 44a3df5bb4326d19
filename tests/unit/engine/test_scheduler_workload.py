"""A seeded random workload against a small pool: every step keeps the scheduler's invariants."""

import random

from tandem.engine.sequence import FinishReason, Lane, SamplingOptions, Sequence

NUM_BLOCKS = 24
BUDGET = 48
MAX_NUM_SEQS = 6
SHARED_PREFIX = list(range(1, 49))


def random_sequence(rng: random.Random, index: int) -> Sequence:
    num_public = rng.choice([0, 16, 48])
    prompt = SHARED_PREFIX[:num_public] + [rng.randint(1, 3) for _ in range(rng.randint(1, 120))]
    return Sequence(
        f"s{index}",
        prompt,
        SamplingOptions(max_tokens=rng.randint(1, 60)),
        lane=rng.choice(list(Lane)),
        tenant=rng.choice(["a", "b"]),
        num_public_prefix_tokens=num_public,
    )


def check_step_invariants(engine, plan, seqs: list[Sequence]) -> None:
    assert sum(c.num_new_tokens for c in plan.scheduled) == plan.num_decode_tokens + plan.num_prefill_tokens <= BUDGET
    assert all(c.num_new_tokens == 1 for c in plan.scheduled[: plan.num_decode_tokens])  # decodes come first
    running = [s for s in seqs if s.block_table]
    assert len(running) <= MAX_NUM_SEQS
    # Every held block is in use and no other is. A reference count off by one shows later: a
    # block freed more often than taken raises, one never dropped keeps the pool from draining.
    holders = {block for s in running for block in s.block_table}
    assert engine.kv.num_used_blocks == len(holders)


def test_a_random_workload_keeps_every_invariant_and_finishes_every_sequence(make_engine):
    rng = random.Random(7)
    engine = make_engine(num_blocks=NUM_BLOCKS, num_reserved_blocks=2, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_NUM_SEQS)
    seqs: list[Sequence] = []
    aborted: set[str] = set()
    while len(seqs) < 80 or engine.scheduler.has_work():
        if len(seqs) < 80 and rng.random() < 0.4:
            seqs.append(random_sequence(rng, len(seqs)))
            engine.scheduler.add(seqs[-1])
        unfinished = [s for s in seqs if s.finish_reason is None and s.seq_id not in aborted]
        if unfinished and rng.random() < 0.03:
            victim = rng.choice(unfinished)
            assert engine.scheduler.abort(victim.seq_id)
            aborted.add(victim.seq_id)
        plan, _ = engine.step()
        check_step_invariants(engine, plan, seqs)
    for s in seqs:
        if s.seq_id in aborted:
            assert s.finish_reason is FinishReason.CANCELLED
        else:
            assert (s.finish_reason, s.num_output_tokens) == (FinishReason.LENGTH, s.sampling.max_tokens)
    assert engine.kv.num_free_blocks == NUM_BLOCKS
    stats = engine.scheduler.stats()
    assert stats.num_prefix_hit_tokens > 0 and stats.num_preemptions > 0  # the workload exercised both
