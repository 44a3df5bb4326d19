"""The disaggregation hooks: prefill on one engine, detach, move the blocks, adopt on another."""

import pytest

from tandem.engine.sequence import FinishReason, SamplingOptions, Sequence, SequenceStatus

PROMPT = list(range(1, 41))
OPTIONS = SamplingOptions(max_tokens=20)


def test_a_sequence_prefilled_on_one_engine_decodes_on_another_to_the_same_tokens(make_engine):
    alone = make_engine()
    reference = Sequence("r", PROMPT, OPTIONS)
    alone.scheduler.add(reference)
    alone.run_until_idle()

    prefill, decode = make_engine(num_blocks=16), make_engine(num_blocks=16)
    source = Sequence("r", PROMPT, OPTIONS)
    prefill.scheduler.add(source)
    while source.num_output_tokens == 0:
        prefill.step()
    prefill.scheduler.detach("r")
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
    assert (imported.finish_reason, imported.output_token_ids) == (FinishReason.LENGTH, reference.output_token_ids)
    assert prefill.kv.num_free_blocks == 16 and decode.kv.num_free_blocks == 16
    assert decode.kv.num_cached_blocks >= 2  # the imported prompt's blocks are findable on the decode side


def test_only_a_running_sequence_can_be_detached(make_engine):
    engine = make_engine(max_num_seqs=1)
    running, waiting = Sequence("running", PROMPT), Sequence("waiting", PROMPT)
    engine.scheduler.add(running)
    engine.scheduler.add(waiting)
    engine.step()
    assert engine.scheduler.detach("running") is running
    assert running.status is SequenceStatus.RUNNING and running.block_table
    with pytest.raises(ValueError, match="only a running sequence"):
        engine.scheduler.detach("waiting")
