import math

import pytest

from tandem.engine.scheduler import EmptyPrompt, PromptTooLong, SchedulerConfig, UpdateResult
from tandem.engine.sequence import FinishReason, Lane, SamplingOptions, Sequence, SequenceStatus


def seq(seq_id: str, num_tokens: int, max_tokens: int = 10_000, lane: Lane = Lane.FREE, first_token: int = 1) -> Sequence:
    return Sequence(seq_id, range(first_token, first_token + num_tokens), SamplingOptions(max_tokens=max_tokens), lane=lane)


def test_a_long_prompt_is_prefilled_in_chunks_while_every_running_decode_keeps_its_step(make_engine):
    engine = make_engine(num_blocks=512, max_num_batched_tokens=64)
    decoders = [seq(f"d{i}", 10, first_token=100 * i) for i in range(8)]
    for s in decoders:
        engine.scheduler.add(s)
    while any(s.num_output_tokens == 0 for s in decoders):
        engine.step()
    long = seq("long", 4000, first_token=5000)
    engine.scheduler.add(long)
    num_steps = 0
    while long.num_output_tokens == 0:
        outputs_before = [s.num_output_tokens for s in decoders]
        plan, _ = engine.step()
        num_steps += 1
        assert [(c.seq, c.num_new_tokens) for c in plan.scheduled[:8]] == [(s, 1) for s in decoders]
        assert plan.num_decode_tokens == 8
        assert plan.num_decode_tokens + plan.num_prefill_tokens <= 64
        assert [s.num_output_tokens for s in decoders] == [n + 1 for n in outputs_before]
        assert (long in plan.sampled_seqs) == (long.num_computed_tokens == 4000)
    assert num_steps == math.ceil(4000 / 56)
    assert long.num_computed_tokens == 4000 and long.num_tokens == 4001


def test_when_blocks_run_out_the_newest_is_preempted_and_later_completes(make_engine):
    engine = make_engine(num_blocks=10, num_reserved_blocks=1, max_num_seqs=3)
    a, b, c = seq("a", 30, max_tokens=40), seq("b", 30, max_tokens=40), seq("c", 30, max_tokens=40)
    queued = seq("queued", 5, max_tokens=1)  # arrived before the preemption, waits for a seat
    for s in (a, b, c, queued):
        engine.scheduler.add(s)
    plan, _ = engine.step()
    assert [chunk.seq for chunk in plan.scheduled] == [a, b, c]
    while not plan.preempted:
        plan, _ = engine.step()
    assert plan.preempted == [c]
    assert (c.status, c.block_table, c.num_computed_tokens) == (SequenceStatus.WAITING, [], 0)
    assert c not in [chunk.seq for chunk in plan.scheduled]
    plans = engine.run_until_idle()
    scheduled = [chunk.seq.seq_id for p in plans for chunk in p.scheduled]
    assert scheduled.index("c") < scheduled.index("queued")  # back at the front of its lane
    for s in (a, b, c):
        assert (s.finish_reason, s.token_ids[30:]) == (FinishReason.LENGTH, list(range(1030, 1070)))
    assert c.num_preemptions >= 1
    assert c.num_cached_tokens == 0  # usage reports the first admission's hit, not the recompute's
    assert engine.scheduler.stats().num_preemptions >= 1
    assert engine.kv.num_free_blocks == 10


def test_admissions_keep_the_reserved_blocks_free(make_engine):
    engine = make_engine(num_blocks=10, num_reserved_blocks=4)
    for i in range(5):
        engine.scheduler.add(seq(f"s{i}", 32, first_token=100 * i))
    engine.scheduler.schedule()
    stats = engine.scheduler.stats()
    assert (stats.num_running[Lane.FREE], stats.num_waiting[Lane.FREE], stats.num_free_blocks) == (3, 2, 4)


def test_paid_is_admitted_before_free_before_background_and_each_lane_in_arrival_order(make_engine):
    engine = make_engine(max_num_seqs=1)
    for seq_id, lane in [("bg1", Lane.BACKGROUND), ("free1", Lane.FREE), ("paid1", Lane.PAID), ("free2", Lane.FREE), ("paid2", Lane.PAID)]:
        engine.scheduler.add(seq(seq_id, 5, max_tokens=1, lane=lane))
    plans = engine.run_until_idle()
    assert [chunk.seq.seq_id for p in plans for chunk in p.scheduled] == ["paid1", "paid2", "free1", "free2", "bg1"]


def test_abort_frees_a_running_and_a_waiting_sequence_at_the_next_step(make_engine):
    engine = make_engine(num_blocks=16, max_num_seqs=1)
    running, waiting = seq("running", 40), seq("waiting", 40, first_token=500)
    engine.scheduler.add(running)
    engine.scheduler.add(waiting)
    engine.step()
    assert running.status is SequenceStatus.RUNNING and waiting.status is SequenceStatus.WAITING
    assert engine.scheduler.abort("running") and engine.scheduler.abort("waiting")
    assert not engine.scheduler.abort("nobody")
    assert engine.kv.num_free_blocks == 13  # nothing is freed before the next step
    plan = engine.scheduler.schedule()
    assert plan.aborted == [running, waiting]
    assert plan.scheduled == []
    assert [s.finish_reason for s in plan.aborted] == [FinishReason.CANCELLED] * 2
    assert (running.block_table, engine.kv.num_free_blocks) == ([], 16)
    assert not engine.scheduler.has_work()


def test_a_prompt_that_can_never_fit_is_refused_with_its_token_and_block_counts(make_engine):
    engine = make_engine(num_blocks=10, num_reserved_blocks=2)
    with pytest.raises(PromptTooLong, match=r"129 tokens needs 9 KV blocks of 16 tokens.*at most 8 blocks \(128 tokens\)"):
        engine.scheduler.add(seq("big", 129))
    engine.scheduler.add(seq("fits", 128))
    with pytest.raises(EmptyPrompt):
        engine.scheduler.add(seq("empty", 0))
    windowed = make_engine(num_blocks=100, max_model_len=64)
    with pytest.raises(PromptTooLong, match="65 tokens is longer than the 64-token context window"):
        windowed.scheduler.add(seq("big", 65))


def test_a_follow_up_turn_hits_the_blocks_of_the_previous_reply(make_engine):
    engine = make_engine()
    turn1 = seq("turn1", 20, max_tokens=30)
    engine.scheduler.add(turn1)
    engine.run_until_idle()
    assert turn1.num_tokens == 50  # 49 computed: 3 full blocks, the third mostly reply
    turn2 = Sequence("turn2", turn1.token_ids + [7, 7, 7, 7, 7], SamplingOptions(max_tokens=1))
    engine.scheduler.add(turn2)
    plan, _ = engine.step()
    assert [(c.seq, c.num_computed_tokens, c.num_new_tokens) for c in plan.scheduled] == [(turn2, 48, 7)]
    assert turn2.num_cached_tokens == 48
    assert engine.scheduler.stats().num_prefix_hit_tokens == 48


def test_eos_and_stop_tokens_finish_with_stop_and_max_tokens_with_length(make_engine):
    engine = make_engine()
    engine.runner.next_token = lambda s: 2
    eos = Sequence("eos", [5, 6], SamplingOptions(max_tokens=9), eos_token_ids=[2])
    ignored = Sequence("ignored", [5, 6], SamplingOptions(max_tokens=3, ignore_eos=True), eos_token_ids=[2])
    stop_token = Sequence("stop_token", [5, 6], SamplingOptions(max_tokens=9, stop_token_ids=(2,)))
    for s in (eos, ignored, stop_token):
        engine.scheduler.add(s)
    engine.run_until_idle()
    assert [(s.finish_reason, s.num_output_tokens) for s in (eos, ignored, stop_token)] == [
        (FinishReason.STOP, 1),
        (FinishReason.LENGTH, 3),
        (FinishReason.STOP, 1),
    ]


def test_a_stop_string_hit_passed_to_update_finishes_the_sequence_and_frees_its_blocks_at_once(make_engine):
    engine = make_engine(num_blocks=8)
    s = seq("s", 20)
    engine.scheduler.add(s)
    engine.step()
    plan = engine.scheduler.schedule()
    result = engine.scheduler.update(plan, engine.runner.execute(plan), stopped_ids={"s"})
    assert result == UpdateResult(finished=[s], handed_off=[])
    assert engine.kv.num_free_blocks == 8
    assert (s.status, s.finish_reason, s.num_output_tokens) == (SequenceStatus.FINISHED, FinishReason.STOP, 2)
    assert not engine.scheduler.has_work()
    assert engine.scheduler.schedule().finished_seq_ids == ["s"]  # the runner forgets it next step


def test_a_token_that_ends_the_sequence_by_length_keeps_length_when_a_stop_string_also_hit(make_engine):
    engine = make_engine()
    s = seq("s", 20, max_tokens=1)
    engine.scheduler.add(s)
    plan = engine.scheduler.schedule()
    assert engine.scheduler.update(plan, engine.runner.execute(plan), stopped_ids={"s"}).finished == [s]
    assert s.finish_reason is FinishReason.LENGTH


def test_every_sequence_that_left_is_named_once_in_the_next_plan_for_the_runner_to_forget(make_engine):
    engine = make_engine()
    done, aborted, running = seq("done", 5, max_tokens=1), seq("aborted", 5), seq("running", 5)
    for s in (done, aborted, running):
        engine.scheduler.add(s)
    plan, _ = engine.step()
    assert plan.finished_seq_ids == []
    engine.scheduler.abort("aborted")
    plan, _ = engine.step()
    assert plan.aborted == [aborted] and plan.finished_seq_ids == ["done", "aborted"]
    plan, _ = engine.step()
    assert plan.finished_seq_ids == []


def test_a_sequence_that_fills_the_whole_pool_finishes_with_length_instead_of_thrashing(make_engine):
    engine = make_engine(num_blocks=4, num_reserved_blocks=0)
    s = seq("s", 60)
    engine.scheduler.add(s)
    engine.run_until_idle(max_steps=20)
    assert (s.finish_reason, s.num_tokens) == (FinishReason.LENGTH, 64)


def test_a_prefill_chunk_without_room_preempts_the_newest_so_the_oldest_always_progresses(make_engine):
    # Two prompts that each need most of the pool: admitted chunk by chunk, they would hold
    # half each and wait for each other forever without preemption.
    engine = make_engine(num_blocks=8, num_reserved_blocks=0, max_num_batched_tokens=32)
    first, second = seq("first", 100, max_tokens=2), seq("second", 100, max_tokens=2, first_token=300)
    engine.scheduler.add(first)
    engine.scheduler.add(second)
    engine.run_until_idle(max_steps=100)
    assert [s.num_output_tokens for s in (first, second)] == [2, 2]
    assert second.num_preemptions >= 1 and first.num_preemptions == 0


def test_queued_prefill_tokens_count_what_waits_and_what_is_still_prefilling_not_decodes(make_engine):
    engine = make_engine(num_blocks=512, max_num_batched_tokens=64)
    decoder, long, waiting = seq("d", 10), seq("long", 200, first_token=1000), seq("w", 30, first_token=3000)
    engine.scheduler.add(decoder)
    engine.step()  # d prefilled: it decodes from now on
    engine.scheduler.add(long)
    engine.scheduler.add(waiting)
    assert engine.scheduler.stats().num_queued_prefill_tokens == 230
    engine.step()  # d decodes one, long prefills 63; the budget leaves w waiting
    assert waiting.status is SequenceStatus.WAITING
    assert engine.scheduler.stats().num_queued_prefill_tokens == (200 - 63) + 30
    while engine.scheduler.has_work() and engine.scheduler.stats().num_queued_prefill_tokens:
        engine.step()
    assert long.num_computed_tokens == 200 and waiting.num_computed_tokens == 30


def test_choices_added_after_the_first_ones_first_token_share_its_full_prompt_blocks_and_write_their_own(make_engine):
    """OpenAI's `n`, as the chat starts it: the first choice alone, the others once its first token
    is out. Their full prompt blocks are the first's physical blocks; the partial last block and
    everything generated go into blocks of their own (the fake runner checks that every choice
    reads back its own tokens, and here each choice writes different ones)."""
    engine = make_engine()
    engine.runner.next_token = lambda s: 1000 * (1 + int(s.seq_id[1:])) + s.num_tokens
    prompt = list(range(1, 41))  # two full blocks of 16 and 8 tokens
    first = Sequence("c0", prompt, SamplingOptions(max_tokens=20))
    engine.scheduler.add(first)
    engine.step()
    assert first.num_tokens == 41
    others = [Sequence(f"c{i}", prompt, SamplingOptions(max_tokens=20)) for i in (1, 2)]
    for other in others:
        engine.scheduler.add(other)
    plan, _ = engine.step()
    assert {(c.seq.seq_id, c.num_computed_tokens, c.num_new_tokens) for c in plan.scheduled if c.seq is not first} == {
        ("c1", 32, 8),
        ("c2", 32, 8),
    }
    for other in others:
        assert other.num_cached_tokens == 32 and other.block_table[:2] == first.block_table[:2]
    assert len({seq.block_table[2] for seq in (first, *others)}) == 3  # the partial block: one each
    engine.run_until_idle()
    assert [seq.token_ids[40:42] for seq in (first, *others)] == [[1040, 1041], [2040, 2041], [3040, 3041]]
    assert engine.scheduler.stats().num_prefix_hit_tokens == 64


def test_choices_added_in_the_same_step_each_compute_the_prompt(make_engine):
    """Why the chat waits for the first choice's first token: a prompt's blocks are cached once
    computed, so sequences admitted together find nothing of each other's."""
    engine = make_engine()
    prompt = list(range(1, 41))
    together = [Sequence(f"c{i}", prompt, SamplingOptions(max_tokens=4)) for i in range(3)]
    for seq in together:
        engine.scheduler.add(seq)
    engine.step()
    assert [seq.num_cached_tokens for seq in together] == [0, 0, 0]
    assert len({block for seq in together for block in seq.block_table[:2]}) == 6


def test_steps_of_prompts_alone_take_the_prefill_only_budget_and_a_running_decode_brings_back_the_step_budget(make_engine):
    """No stream waits on a step in which nothing decodes: its prompts take up to
    max_num_prefill_only_tokens. Once one sequence decodes, every step keeps to the step budget."""
    engine = make_engine(num_blocks=512, max_num_batched_tokens=64, max_num_prefill_only_tokens=256)
    first = seq("first", 600, max_tokens=4)
    engine.scheduler.add(first)
    sizes = []
    while first.num_output_tokens == 0:
        plan, _ = engine.step()
        assert plan.num_decode_tokens == 0
        sizes.append(plan.num_prefill_tokens)
    assert sizes == [256, 256, 88]
    second = seq("second", 600, first_token=5000)
    engine.scheduler.add(second)
    plan, _ = engine.step()  # first decodes: the step budget binds the second's chunk
    assert (plan.num_decode_tokens, plan.num_prefill_tokens) == (1, 63)
    while first.finish_reason is None:
        plan, _ = engine.step()
        assert plan.num_decode_tokens + plan.num_prefill_tokens <= 64
    plan, _ = engine.step()  # first finished, the second still prefilling: prompts alone again
    assert (plan.num_decode_tokens, plan.num_prefill_tokens) == (0, 256)


def test_a_prefill_only_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="invalid scheduler config"):
        SchedulerConfig(max_num_prefill_only_tokens=0)
