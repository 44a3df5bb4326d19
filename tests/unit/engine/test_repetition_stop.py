"""The repetition stop (engine/repetition.py): an output that ends with one n-gram repeated, its
copies in a row at least `min_repeats` and covering at least `min_span_tokens`, ends at the token
that completes the last copy, with finish LENGTH and stop reason REPETITION; ordinary output,
the prompt's own repetitions, the first min_tokens and ignore_eos replies never do."""

from __future__ import annotations

import random

import pytest
from test_engine import tiny  # noqa: F401  (tiny: the module's fixture)

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.repetition import RepetitionStop
from tandem.engine.sequence import FinishReason, SamplingOptions, Sequence, StopReason

PROMPT = [3, 4, 5, 6, 7]


def first_stop(stop: RepetitionStop, output: list[int], prompt: list[int] = PROMPT, **sampling) -> tuple[int, int] | None:
    """(output tokens when it first fires, the n-gram's length), appending `output` token by token."""
    seq = Sequence("s", prompt, SamplingOptions(max_tokens=10_000, **sampling))
    for token_id in output:
        seq.append_token(token_id)
        ngram = stop.repeated_ngram(seq)
        if ngram is not None:
            return seq.num_output_tokens, ngram
    return None


def distinct(num_tokens: int, first: int = 100) -> list[int]:
    return list(range(first, first + num_tokens))


@pytest.mark.parametrize("ngram", [1, 2, 5, 8, 13])
def test_an_ngram_repeated_k_times_stops_at_the_token_completing_the_kth_copy(ngram):
    stop = RepetitionStop(max_ngram_tokens=16, min_repeats=4, min_span_tokens=0)
    lead = distinct(7, first=500)  # an answer that starts plainly, then loops
    output = lead + distinct(ngram) * 6
    assert first_stop(stop, output) == (len(lead) + 4 * ngram, ngram)
    assert first_stop(stop, lead + distinct(ngram) * 3 + distinct(ngram)[:-1]) is None, "one token short of the 4th copy"


def test_a_short_ngram_must_repeat_until_its_copies_cover_the_minimum_span():
    stop = RepetitionStop(max_ngram_tokens=64, min_repeats=3, min_span_tokens=64)
    assert stop.repeats_needed(1) == 64 and stop.repeats_needed(8) == 8 and stop.repeats_needed(30) == 3
    assert first_stop(stop, [9] * 100) == (64, 1), "a run of one token: 64 of them"
    assert first_stop(stop, [9] * 63 + [10]) is None, "18 nines in a number, or 63, are text"
    assert first_stop(stop, distinct(8) * 20) == (64, 8)
    assert first_stop(stop, distinct(30) * 5) == (90, 30), "a long line three times"


def test_an_ngram_longer_than_the_largest_looked_for_is_not_seen():
    assert first_stop(RepetitionStop(max_ngram_tokens=16, min_repeats=3, min_span_tokens=0), distinct(17) * 10) is None
    assert first_stop(RepetitionStop(max_ngram_tokens=17, min_repeats=3, min_span_tokens=0), distinct(17) * 10) == (51, 17)


def test_ordinary_output_and_near_repeats_never_stop():
    rng = random.Random(0)
    few_words = [rng.randrange(50, 90) for _ in range(3000)]  # a 40-token vocabulary: short runs happen
    assert first_stop(RepetitionStop(), few_words) is None, "the defaults: no run of them covers 64 tokens"
    assert first_stop(RepetitionStop(min_span_tokens=0), few_words) is not None, "three copies alone are too few"
    stop = RepetitionStop(max_ngram_tokens=64, min_repeats=3, min_span_tokens=0)
    line = distinct(10)
    varied = [t for i in range(20) for t in [*line[:-1], 900 + i]]  # the same line, each ending differently
    assert first_stop(stop, varied) is None


def test_only_output_counts_and_a_continuation_sees_a_loop_across_its_boundary():
    stop = RepetitionStop(max_ngram_tokens=8, min_repeats=4, min_span_tokens=0)
    loop = distinct(3)
    assert first_stop(stop, loop, prompt=loop * 10) is None, "the prompt's repetitions are not the reply's"
    # A continuation (engine._sequence): the tokens generated before it follow the prompt as output.
    seq = Sequence("s", PROMPT, SamplingOptions(max_tokens=100))
    for token_id in loop * 3 + loop[:2]:  # logged by the worker that died
        seq.append_token(token_id)
    seq.append_token(loop[2])  # the next worker's first token
    assert stop.repeated_ngram(seq) == 3


def test_min_tokens_and_ignore_eos_replies_are_never_stopped():
    stop = RepetitionStop(max_ngram_tokens=8, min_repeats=4, min_span_tokens=0)
    assert first_stop(stop, [9] * 50, min_tokens=20) == (21, 1)
    assert first_stop(stop, [9] * 50, ignore_eos=True) is None


def scheduled(make_engine, stop: RepetitionStop | None, next_token, max_tokens: int = 60) -> Sequence:
    """One reply through the scheduler and the fake runner (conftest.py), its tokens `next_token`'s."""
    engine = make_engine(repetition_stop=stop)
    engine.runner.next_token = next_token
    seq = Sequence("s", PROMPT, SamplingOptions(max_tokens=max_tokens))
    engine.scheduler.add(seq)
    engine.run_until_idle()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "it finished and gave back its blocks"
    return seq


def test_the_scheduler_ends_a_looping_reply_with_length_and_the_repetition_reason(make_engine):
    stop = RepetitionStop(max_ngram_tokens=8, min_repeats=4, min_span_tokens=0)
    looping = scheduled(make_engine, stop, lambda seq: 40 + seq.num_output_tokens % 5)  # 40..44 over and over
    assert (looping.finish_reason, looping.stop_reason, looping.num_output_tokens) == (FinishReason.LENGTH, StopReason.REPETITION, 20)
    plain = scheduled(make_engine, stop, lambda seq: 1000 + seq.num_tokens)
    assert (plain.finish_reason, plain.stop_reason, plain.num_output_tokens) == (FinishReason.LENGTH, None, 60)
    off = scheduled(make_engine, None, lambda seq: 40 + seq.num_output_tokens % 5)
    assert (off.finish_reason, off.stop_reason, off.num_output_tokens) == (FinishReason.LENGTH, None, 60)


def test_max_tokens_reached_by_the_same_token_is_plain_length(make_engine):
    stop = RepetitionStop(max_ngram_tokens=8, min_repeats=4, min_span_tokens=0)
    seq = scheduled(make_engine, stop, lambda seq: 40 + seq.num_output_tokens % 5, max_tokens=20)
    assert (seq.finish_reason, seq.stop_reason) == (FinishReason.LENGTH, None)


def test_the_engine_stops_a_reply_forced_to_repeat_and_names_the_reason_on_its_last_output(tiny):  # noqa: F811
    stop = RepetitionStop(max_ngram_tokens=8, min_repeats=6, min_span_tokens=0)
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64, repetition_stop=stop))
    forced = SamplingOptions(max_tokens=40, logit_bias=((65, 100.0),))  # "A", whatever the model says
    stream = engine.generate([Request("r", tuple(PROMPT), forced)])["r"]
    assert [t for output in stream for t in output.new_token_ids] == [65] * 6
    assert (stream[-1].finish_reason, stream[-1].stop_reason) == (FinishReason.LENGTH, StopReason.REPETITION)
    assert all(output.stop_reason is None for output in stream[:-1])
    # A continuation of it on another engine, its five As logged before: one more ends it.
    other = Engine(tiny, EngineConfig(num_kv_blocks=64, repetition_stop=stop))
    continued = other.generate([Request("c", tuple(PROMPT), forced, generated_token_ids=(65,) * 5)])["c"]
    assert [output.new_token_ids for output in continued] == [(65,)]
    assert (continued[-1].stop_reason, continued[-1].num_output_tokens) == (StopReason.REPETITION, 6)


def test_the_engine_without_a_repetition_stop_writes_to_max_tokens(tiny):  # noqa: F811
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    forced = SamplingOptions(max_tokens=40, logit_bias=((65, 100.0),))
    stream = engine.generate([Request("r", tuple(PROMPT), forced)])["r"]
    assert len(stream) == 40 and (stream[-1].finish_reason, stream[-1].stop_reason) == (FinishReason.LENGTH, None)
