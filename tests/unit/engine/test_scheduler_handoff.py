"""The disaggregation hooks: prefill on one engine, hand off, move the blocks, adopt on another."""

from tandem.engine.scheduler import UpdateResult
from tandem.engine.sequence import FinishReason, SamplingOptions, Sequence, SequenceStatus

PROMPT = list(range(1, 41))
OPTIONS = SamplingOptions(max_tokens=20)


def test_a_sequence_prefilled_on_one_engine_decodes_on_another_to_the_same_tokens(make_engine):
    alone = make_engine()
    reference = Sequence("r", PROMPT, OPTIONS)
    alone.scheduler.add(reference)
    alone.run_until_idle()

    prefill, decode = make_engine(num_blocks=16), make_engine(num_blocks=16)
    source = Sequence("r", PROMPT, OPTIONS, is_prefill_only=True)
    prefill.scheduler.add(source)
    _, result = prefill.step()
    assert result.handed_off == [source] and source.num_output_tokens == 1
    assert not prefill.scheduler.has_work() and prefill.kv.num_used_blocks == 3  # still held for the export

    reservation = decode.kv.reserve_import(Sequence("r", PROMPT, OPTIONS), len(source.block_table))  # the decode side reserves first
    block_ids = reservation.block_ids
    for src, dst in zip(source.block_table, block_ids):  # "the transfer"
        size = prefill.kv.block_size
        decode.runner.kv_tokens[dst * size : (dst + 1) * size] = prefill.runner.kv_tokens[src * size : (src + 1) * size]
    imported = Sequence("r", PROMPT, OPTIONS)
    imported.attach_computed_blocks(block_ids, [], source.num_computed_tokens)
    imported.append_token(source.last_token_id)
    decode.scheduler.adopt(imported, num_cached_tokens=source.num_cached_tokens)
    prefill.kv.free(source)

    plans = decode.run_until_idle()
    assert plans[0].num_decode_tokens == 1 and plans[0].num_prefill_tokens == 0  # no prefill on the decode side
    assert imported.finish_reason is FinishReason.LENGTH
    assert imported.token_ids == reference.token_ids and reference.num_output_tokens == 20
    assert prefill.kv.num_free_blocks == 16 and decode.kv.num_free_blocks == 16
    assert decode.kv.num_cached_blocks >= 2  # the imported prompt's blocks are findable on the decode side


def test_a_prefill_only_sequence_is_handed_off_with_its_blocks_once_its_first_token_is_sampled_not_before(make_engine):
    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=16)
    running, waiting = Sequence("running", PROMPT, is_prefill_only=True), Sequence("waiting", PROMPT, is_prefill_only=True)
    engine.scheduler.add(running)
    engine.scheduler.add(waiting)
    for _ in range(2):  # chunks of 16 and 16 tokens: no token yet
        _, result = engine.step()
        assert result == UpdateResult(finished=[], handed_off=[])
    _, result = engine.step()  # the last 8 prompt tokens, then its first token
    assert result == UpdateResult(finished=[], handed_off=[running])
    assert (running.status, running.num_output_tokens, len(running.block_table)) == (SequenceStatus.RUNNING, 1, 3)
    assert waiting.status is SequenceStatus.WAITING and engine.scheduler.has_work()
    plan, _ = engine.step()
    assert plan.finished_seq_ids == ["running"] and [chunk.seq for chunk in plan.scheduled] == [waiting]


def test_a_prefill_only_sequence_its_first_token_finishes_is_finished_not_handed_off(make_engine):
    engine = make_engine()
    s = Sequence("s", PROMPT, SamplingOptions(max_tokens=1), is_prefill_only=True)
    engine.scheduler.add(s)
    _, result = engine.step()
    assert result == UpdateResult(finished=[s], handed_off=[])
    assert s.finish_reason is FinishReason.LENGTH and engine.kv.num_used_blocks == 0
