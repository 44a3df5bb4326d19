"""Lanes decide who goes first and who gives way: paid before free before background at
admission, background then free (newest first) when blocks or seats run out, background only on
idle capacity, and users round-robin within a lane."""

from tandem.engine.sequence import Lane, SamplingOptions, Sequence, SequenceStatus


def seq(seq_id: str, num_tokens: int, max_tokens: int = 10_000, lane: Lane = Lane.FREE, user: str = "", first_token: int = 1) -> Sequence:
    return Sequence(seq_id, range(first_token, first_token + num_tokens), SamplingOptions(max_tokens=max_tokens), lane=lane, user_id=user)


def admitted_order(plans) -> list[str]:
    """Each sequence's id at its first chunk, in the order the steps scheduled them."""
    order: list[str] = []
    for plan in plans:
        for chunk in plan.scheduled:
            if chunk.seq.seq_id not in order:
                order.append(chunk.seq.seq_id)
    return order


def test_within_a_lane_users_are_admitted_round_robin_so_a_heavy_user_cannot_starve_another(make_engine):
    engine = make_engine(max_num_seqs=1)
    for i in range(10):
        engine.scheduler.add(seq(f"a{i}", 5, max_tokens=1, user="alice", first_token=10 * i + 1))
    engine.scheduler.add(seq("b0", 5, max_tokens=1, user="bob", first_token=500))
    engine.scheduler.add(seq("b1", 5, max_tokens=1, user="bob", first_token=600))
    order = admitted_order(engine.run_until_idle())
    assert order[:4] == ["a0", "b0", "a1", "b1"]
    assert order[4:] == [f"a{i}" for i in range(2, 10)]  # each user's own requests stay in arrival order


def test_a_paid_sequence_without_a_block_preempts_an_older_free_one_not_itself(make_engine):
    engine = make_engine(num_blocks=8, num_reserved_blocks=0)
    free = seq("free", 48, max_tokens=200)
    engine.scheduler.add(free)
    engine.step()
    paid = seq("paid", 48, max_tokens=200, lane=Lane.PAID, first_token=500)
    engine.scheduler.add(paid)
    preempted = []
    while not preempted:
        plan, _ = engine.step()
        preempted = plan.preempted
    assert preempted == [free]
    assert paid.status is SequenceStatus.RUNNING and paid.num_preemptions == 0


def test_blocks_running_out_preempt_background_first_then_free_newest_first_and_never_paid_while_they_run(make_engine):
    engine = make_engine(num_blocks=20, num_reserved_blocks=1)
    paid = seq("paid", 16, max_tokens=200, lane=Lane.PAID, first_token=100)
    free_old, free_new = seq("free-old", 16, max_tokens=200, first_token=300), seq("free-new", 16, max_tokens=200, first_token=500)
    for s in (paid, free_old, free_new):
        engine.scheduler.add(s)
    engine.step()
    background = seq("background", 16, max_tokens=200, lane=Lane.BACKGROUND, first_token=700)
    engine.scheduler.add(background)
    engine.step()
    assert background.status is SequenceStatus.RUNNING  # nothing waited and the blocks were plentiful
    victims = []
    while engine.scheduler.has_work():
        running_before = [s for s in (paid, free_old, free_new, background) if s.status is SequenceStatus.RUNNING]
        plan, _ = engine.step()
        for victim in plan.preempted:
            lowest = max(s.lane for s in running_before)
            assert victim.lane == lowest, f"{victim.seq_id} gave way while a lower lane ran"
            assert victim.arrival_order == max(s.arrival_order for s in running_before if s.lane == lowest)
            running_before.remove(victim)
            victims.append(victim.seq_id)
    assert victims[0] == "background"
    assert "free-new" in victims
    assert paid.num_preemptions == 0


def test_a_waiting_paid_sequence_takes_the_seat_of_a_running_free_one(make_engine):
    engine = make_engine(max_num_seqs=1)
    free = seq("free", 5, max_tokens=100)
    engine.scheduler.add(free)
    engine.step()
    paid = seq("paid", 5, max_tokens=100, lane=Lane.PAID, first_token=500)
    engine.scheduler.add(paid)
    plan, _ = engine.step()
    assert plan.preempted == [free]
    assert [chunk.seq for chunk in plan.scheduled] == [paid]
    assert (free.status, paid.status) == (SequenceStatus.WAITING, SequenceStatus.RUNNING)


def test_background_is_admitted_only_when_nothing_else_waits_and_blocks_are_plentiful(make_engine):
    engine = make_engine(num_blocks=20, num_reserved_blocks=0, max_num_seqs=1)
    first = seq("first", 16, max_tokens=3)
    waiting = seq("waiting", 16, max_tokens=1, first_token=300)
    background = seq("background", 16, max_tokens=1, lane=Lane.BACKGROUND, first_token=500)
    for s in (first, waiting, background):
        engine.scheduler.add(s)
    assert not engine.scheduler.stats().has_idle_capacity
    order = admitted_order(engine.run_until_idle())
    assert order == ["first", "waiting", "background"]

    engine = make_engine(num_blocks=20, num_reserved_blocks=0)
    big = seq("big", 16 * 12, max_tokens=5)  # holds 13 of 20 blocks: fewer than half are free
    engine.scheduler.add(big)
    engine.step()
    engine.scheduler.add(background := seq("background", 16, max_tokens=1, lane=Lane.BACKGROUND, first_token=500))
    plan, _ = engine.step()
    assert background not in [chunk.seq for chunk in plan.scheduled] and not engine.scheduler.stats().has_idle_capacity
    engine.run_until_idle()
    assert background.status is SequenceStatus.FINISHED  # admitted once the big one left


def test_stats_split_the_queued_prefill_tokens_by_lane_and_running_prefills(make_engine):
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=16)
    engine.scheduler.add(seq("running", 40, lane=Lane.FREE))
    engine.step()  # 16 of 40 computed
    engine.scheduler.add(seq("paid", 7, lane=Lane.PAID, first_token=300))
    engine.scheduler.add(seq("background", 9, lane=Lane.BACKGROUND, first_token=500))
    stats = engine.scheduler.stats()
    assert stats.num_running_prefill_tokens == {Lane.PAID: 0, Lane.FREE: 24, Lane.BACKGROUND: 0}
    assert stats.num_waiting_prefill_tokens == {Lane.PAID: 7, Lane.FREE: 0, Lane.BACKGROUND: 9}
    assert stats.num_queued_prefill_tokens == 40


def test_background_admissions_in_one_step_stop_once_blocks_are_no_longer_plentiful(make_engine):
    engine = make_engine(num_blocks=20, num_reserved_blocks=0)
    jobs = [seq(f"bg{i}", 16 * 4, max_tokens=1, lane=Lane.BACKGROUND, first_token=100 * i + 1) for i in range(4)]
    for job in jobs:
        engine.scheduler.add(job)
    plan, _ = engine.step()
    # 4 blocks each: after three, 8 of 20 are free, fewer than half; the fourth would still fit.
    assert [chunk.seq.seq_id for chunk in plan.scheduled] == ["bg0", "bg1", "bg2"]


def test_a_paid_arrival_gets_a_step_of_its_own_and_free_sequences_resume_after_it(make_engine):
    engine = make_engine(max_num_batched_tokens=512)
    free = [seq(f"free{i}", 20, max_tokens=100, first_token=100 * i + 1) for i in range(4)]
    for s in free:
        engine.scheduler.add(s)
    engine.step()
    paid = seq("paid", 30, max_tokens=100, lane=Lane.PAID, first_token=900)
    engine.scheduler.add(paid)
    plan, _ = engine.step()
    assert [chunk.seq.seq_id for chunk in plan.scheduled] == ["paid"]
    assert plan.num_unpaid_tokens == 0
    plan, _ = engine.step()  # nothing paid waits: everyone decodes again
    assert {chunk.seq.seq_id for chunk in plan.scheduled} == {"paid", *(s.seq_id for s in free)}


def test_unpaid_rows_per_step_are_capped_while_paid_work_runs_and_paid_rows_are_not(make_engine):
    engine = make_engine(max_num_batched_tokens=512, max_num_unpaid_tokens=24)
    for i in range(3):
        engine.scheduler.add(seq(f"free{i}", 40, max_tokens=100, first_token=100 * i + 1))
    engine.scheduler.add(seq("background", 40, max_tokens=100, lane=Lane.BACKGROUND, first_token=700))
    plan, _ = engine.step()
    assert plan.num_unpaid_tokens == plan.num_prefill_tokens == 160  # nothing paid runs: the budget is theirs
    paid = seq("paid", 200, max_tokens=4, lane=Lane.PAID, first_token=900)
    engine.scheduler.add(paid)
    plan, _ = engine.step()
    assert [(chunk.seq.seq_id, chunk.num_new_tokens) for chunk in plan.scheduled] == [("paid", 200)]
    for i in range(3, 6):
        engine.scheduler.add(seq(f"free{i}", 40, max_tokens=100, first_token=100 * i + 1))
    plans = [engine.step()[0] for _ in range(3)]  # paid decodes its last three tokens
    assert paid.status is SequenceStatus.FINISHED
    assert [sum(chunk.num_new_tokens for chunk in plan.scheduled if chunk.seq is paid) for plan in plans] == [1, 1, 1]
    assert [plan.num_unpaid_tokens for plan in plans] == [24, 24, 24]  # the cap, not the budget, ended them
    assert all(plan.num_prefill_tokens + plan.num_decode_tokens == plan.num_unpaid_tokens + 1 for plan in plans)
    plan, _ = engine.step()  # paid is done: the rest of the new prompts in one step
    assert plan.num_unpaid_tokens > 24
    assert all(chunk.seq.num_uncomputed_tokens <= 1 for chunk in plan.scheduled)


def test_running_prefills_take_the_budget_in_lane_order(make_engine):
    engine = make_engine(max_num_batched_tokens=64)
    free = seq("free", 300, max_tokens=10)
    engine.scheduler.add(free)
    engine.step()  # free starts its prefill (64 of 300)
    paid = seq("paid", 300, max_tokens=10, lane=Lane.PAID, first_token=900)
    engine.scheduler.add(paid)
    engine.step()  # paid's own step: admitted with its first chunk
    plan, _ = engine.step()  # both are running prefills now
    assert [chunk.seq.seq_id for chunk in plan.scheduled] == ["paid"]
    assert free.num_computed_tokens == 64


def test_a_free_sequence_preempted_for_a_running_one_does_not_keep_a_waiting_paid_one_out(make_engine):
    """Blocks full: a running paid decode that needs a block preempts a free sequence; a paid
    request waiting in that step is still admitted (preempting more free ones), not held back
    until no running sequence needs a block."""
    engine = make_engine(num_blocks=11, num_reserved_blocks=0, max_num_batched_tokens=512)
    running_paid = seq("paid-running", 47, max_tokens=200, lane=Lane.PAID, first_token=1)
    engine.scheduler.add(running_paid)
    engine.step()  # its step alone: 47 prompt tokens in three blocks, and its first token
    free = [seq(f"free{i}", 32, max_tokens=200, first_token=100 * i + 101) for i in range(4)]
    for s in free:
        engine.scheduler.add(s)
    engine.step()  # paid decodes at position 47; four prompts of 32 tokens take the other 8 blocks
    assert engine.kv.num_free_blocks == 0 and all(s.status is SequenceStatus.RUNNING for s in free)
    paid = seq("paid", 20, max_tokens=10, lane=Lane.PAID, first_token=900)
    engine.scheduler.add(paid)
    plan, _ = engine.step()  # the running paid decode, at position 48, needs a fourth block
    assert len(running_paid.block_table) == 4
    assert plan.preempted and all(victim.lane is Lane.FREE for victim in plan.preempted)
    assert paid.status is SequenceStatus.RUNNING
    assert [chunk.seq.seq_id for chunk in plan.scheduled] == ["paid-running", "paid"]
