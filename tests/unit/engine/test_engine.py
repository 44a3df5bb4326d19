"""The engine with a real (tiny, random-weight) Llama: batched, chunked, paged and cached output
equals a naive one-sequence forward token for token; handoffs between engines are exact."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from reference_model import random_model, reference_greedy, reference_hidden, tiny_config
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tandem.engine.engine import Engine, EngineConfig, Request, TokenIdOutOfRange
from tandem.engine.scheduler import PromptTooLong
from tandem.engine.sequence import FinishReason, Lane, SamplingOptions
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.loader import LoadedModel
from tandem.models.tokenizer import Tokenizer

NUM_NEW_TOKENS = 12


def byte_level_tokenizer(vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """256 byte tokens (no merges) and filler tokens up to the tiny model's vocabulary."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), vocab_size)})
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=eos_token_ids, chat_template=None)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    config = tiny_config(vocab_size=512, max_position_embeddings=1024)
    model = random_model(config, seed=0, attention=paged_attention_reference)
    return LoadedModel(model=model.eval(), config=config, tokenizer=byte_level_tokenizer(config.vocab_size))


def seeded_prompts(num_prompts: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 31, 33, 64, 100, 150] + [rng.randint(3, 200) for _ in range(num_prompts - 10)]
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths[:num_prompts]]


def greedy(request_id: str, prompt: list[int], **options) -> Request:
    sampling = SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, **options)
    return Request(request_id, tuple(prompt), sampling)


def tokens_of(stream) -> list[int]:
    return [t for output in stream for t in output.new_token_ids]


def test_batched_chunked_output_equals_the_naive_reference_cold_and_warm(tiny):
    prompts = seeded_prompts(20)
    expected = [reference_greedy(tiny.model, p, NUM_NEW_TOKENS) for p in prompts]
    engine = Engine(tiny, EngineConfig(num_kv_blocks=400, max_num_batched_tokens=48))
    cold = engine.generate([greedy(f"cold-{i}", p) for i, p in enumerate(prompts)])
    assert [tokens_of(cold[f"cold-{i}"]) for i in range(20)] == expected
    assert engine.stats().num_steps > sum(len(p) for p in prompts) // 48, "the small budget forces chunked prefill"

    warm = engine.generate([greedy(f"warm-{i}", p) for i, p in enumerate(prompts)])
    assert [tokens_of(warm[f"warm-{i}"]) for i in range(20)] == expected
    cached = [warm[f"warm-{i}"][-1].num_cached_tokens for i in range(20)]
    assert all(c == (len(p) - 1) // 16 * 16 for c, p in zip(cached, prompts)), "every full prompt block is a hit"


def test_a_follow_up_turn_reuses_the_reply_it_just_wrote(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    prompt = seeded_prompts(10)[8][:90]
    first = tokens_of(engine.generate([greedy("turn-1", prompt)])["turn-1"])
    follow_up = prompt + first + [7, 8, 9]
    stream = engine.generate([greedy("turn-2", follow_up)])["turn-2"]
    # Turn 1 computed KV for 90 + 11 tokens (its last token was sampled, never fed back): six full
    # blocks, the sixth made of prompt and reply tokens.
    assert stream[-1].num_cached_tokens == 96 > len(prompt)
    assert tokens_of(stream) == reference_greedy(tiny.model, follow_up, NUM_NEW_TOKENS)


def test_prefill_on_one_engine_then_decode_on_another_equals_one_engine(tiny):
    prompt = seeded_prompts(10)[9]  # 150 tokens
    expected = reference_greedy(tiny.model, prompt, NUM_NEW_TOKENS)
    prefill = Engine(tiny, EngineConfig(num_kv_blocks=64))
    decode = Engine(tiny, EngineConfig(num_kv_blocks=64))
    decode.generate([greedy("other", seeded_prompts(10)[5])])  # its pool is not fresh: block ids differ

    prefill.add(greedy("r", prompt), prefill_only=True)
    outputs = []
    while not outputs:
        outputs = prefill.step()
    (first,) = outputs
    assert first.handoff is not None and not first.is_finished
    reservation = decode.reserve_import(greedy("r", prompt), len(first.handoff.block_ids))
    block_ids = reservation.block_ids
    assert reservation.cached_block_ids == () and block_ids != first.handoff.block_ids
    for source, target in zip(first.handoff.block_ids, block_ids):
        decode.block_view(target).copy_(prefill.block_view(source))
    free_before_release = prefill.kv.num_free_blocks
    prefill.release("r")
    assert prefill.kv.num_free_blocks == free_before_release + len(block_ids)
    assert not prefill.has_work()

    decode.import_sequence(greedy("r", prompt), reservation, first.new_token_ids[0])
    stream = []
    while decode.has_work():
        stream.extend(decode.step())
    assert [first.new_token_ids[0], *tokens_of(stream)] == expected
    assert stream[-1].finish_reason is FinishReason.LENGTH


def _prefill_only(engine: Engine, request: Request):
    engine.add(request, prefill_only=True)
    outputs = []
    while not outputs:
        outputs = engine.step()
    (first,) = outputs
    assert first.handoff is not None
    return first


def test_a_decode_engine_reserves_only_the_blocks_its_prefix_cache_lacks_and_the_import_is_exact(tiny):
    history = seeded_prompts(10)[9][:96]  # six full blocks the decode engine will hold
    prompt = history + seeded_prompts(10)[8][:70]
    expected = reference_greedy(tiny.model, prompt, NUM_NEW_TOKENS)
    prefill = Engine(tiny, EngineConfig(num_kv_blocks=64))
    decode = Engine(tiny, EngineConfig(num_kv_blocks=64))
    decode.generate([Request("earlier", tuple(history), SamplingOptions(max_tokens=1))])
    free_at_start = decode.kv.num_free_blocks

    first = _prefill_only(prefill, greedy("r", prompt))
    num_blocks = len(first.handoff.block_ids)
    reservation = decode.reserve_import(greedy("r", prompt), num_blocks)
    assert len(reservation.cached_block_ids) == 6 and len(reservation.new_block_ids) == num_blocks - 6
    assert decode.kv.num_free_blocks == free_at_start - num_blocks
    for source, target in zip(first.handoff.block_ids[6:], reservation.new_block_ids):  # only what it lacks
        decode.block_view(target).copy_(prefill.block_view(source))
    prefill.release("r")
    decode.import_sequence(greedy("r", prompt), reservation, first.new_token_ids[0])
    stream = []
    while decode.has_work():
        stream.extend(decode.step())
    assert [first.new_token_ids[0], *tokens_of(stream)] == expected
    assert decode.kv.num_free_blocks == free_at_start


def test_a_cancelled_import_reservation_gives_back_every_block_and_keeps_the_cache(tiny):
    history = seeded_prompts(10)[9][:64]
    decode = Engine(tiny, EngineConfig(num_kv_blocks=64))
    decode.generate([Request("earlier", tuple(history), SamplingOptions(max_tokens=1))])
    free_at_start, cached_at_start = decode.kv.num_free_blocks, decode.kv.num_cached_blocks
    reservation = decode.reserve_import(greedy("r", history + [5] * 40), 7)
    assert len(reservation.cached_block_ids) == 4
    decode.cancel_import(reservation)
    assert (decode.kv.num_free_blocks, decode.kv.num_cached_blocks) == (free_at_start, cached_at_start)


def test_a_continuation_neither_repeats_nor_counts_twice_the_tokens_it_was_given(tiny):
    prompt = seeded_prompts(10)[9]
    expected = reference_greedy(tiny.model, prompt, NUM_NEW_TOKENS)
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    request = Request(
        "c", tuple(prompt), SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True), generated_token_ids=tuple(expected[:3])
    )
    stream = engine.generate([request])["c"]
    assert tokens_of(stream) == expected[3:]
    assert stream[-1].num_output_tokens == NUM_NEW_TOKENS and stream[-1].num_prompt_tokens == len(prompt)
    full_text = tiny.tokenizer.decode(expected)
    assert "".join(o.text for o in stream) == full_text[len(tiny.tokenizer.decode(expected[:3])) :]


def test_abort_frees_every_block_and_reports_cancelled(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    free_at_start = engine.kv.num_free_blocks
    engine.add(greedy("running", seeded_prompts(10)[7]))
    engine.add(greedy("waiting", seeded_prompts(10)[8]))
    engine.step()
    assert engine.abort("running") and engine.abort("waiting")
    outputs = engine.step()
    assert {o.request_id: o.finish_reason for o in outputs} == {
        "running": FinishReason.CANCELLED,
        "waiting": FinishReason.CANCELLED,
    }
    assert not engine.has_work()
    assert engine.kv.num_free_blocks == free_at_start


def test_a_prompt_that_can_never_fit_is_refused_clearly(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=8, num_reserved_blocks=2))
    with pytest.raises(PromptTooLong, match=r"a prompt of 200 tokens needs 13 KV blocks"):
        engine.add(greedy("huge", [5] * 200))
    assert not engine.has_work()


def test_stop_token_and_max_tokens_set_the_finish_reason(tiny):
    prompt = seeded_prompts(10)[4]
    expected = reference_greedy(tiny.model, prompt, NUM_NEW_TOKENS)
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    stopped = engine.generate([greedy("s", prompt, stop_token_ids=(expected[3],))])["s"]
    assert tokens_of(stopped) == expected[: expected.index(expected[3]) + 1]
    assert stopped[-1].finish_reason is FinishReason.STOP
    capped = engine.generate([Request("c", tuple(prompt), SamplingOptions(max_tokens=2, ignore_eos=True))])["c"]
    assert tokens_of(capped) == expected[:2] and capped[-1].finish_reason is FinishReason.LENGTH


def test_min_tokens_holds_back_eos_and_stop_tokens_and_ignore_eos_runs_to_max_tokens(tiny):
    prompt = seeded_prompts(10)[4]
    expected = reference_greedy(tiny.model, prompt, NUM_NEW_TOKENS)
    eos = expected[3]
    with_eos = replace(tiny, tokenizer=byte_level_tokenizer(tiny.config.vocab_size, (eos,)))
    engine = Engine(with_eos, EngineConfig(num_kv_blocks=64))

    def run(**options) -> list[int]:
        sampling = SamplingOptions(max_tokens=NUM_NEW_TOKENS, **options)
        return tokens_of(engine.generate([Request("r", tuple(prompt), sampling)])["r"])

    first_eos = expected.index(eos)
    assert run() == expected[: first_eos + 1], "the model's eos ends the reply"
    assert run(ignore_eos=True) == expected
    held = run(min_tokens=first_eos + 2)
    assert held[:first_eos] == expected[:first_eos] and held[first_eos] != eos, "eos is masked, the next likeliest is taken"
    assert len(held) >= first_eos + 2 and eos not in held[: first_eos + 1]
    stop = run(ignore_eos=True, stop_token_ids=(eos,), min_tokens=first_eos + 2)
    assert stop[:first_eos] == expected[:first_eos] and eos not in stop[: first_eos + 1] and len(stop) >= first_eos + 2


def penalised_reference_greedy(model, prompt: list[int], num_new_tokens: int, **options) -> list[int]:
    """Greedy tokens under the penalties, each written out on the whole sequence recomputed, one
    token at a time: logit_bias added; repetition_penalty over every distinct token of prompt and
    output (positive / p, negative * p); then frequency * count + presence for each output token."""
    presence, frequency = options.get("presence_penalty", 0.0), options.get("frequency_penalty", 0.0)
    repetition, bias = options.get("repetition_penalty", 1.0), dict(options.get("logit_bias", ()))
    ids, output = list(prompt), []
    with torch.inference_mode():
        for _ in range(num_new_tokens):
            logits = model.compute_logits(reference_hidden(model, ids)[-1:])[0].float().tolist()
            for token_id, value in bias.items():
                logits[token_id] += value
            for token_id in set(ids):
                logits[token_id] = logits[token_id] / repetition if logits[token_id] > 0 else logits[token_id] * repetition
            for token_id in set(output):
                logits[token_id] -= frequency * output.count(token_id) + presence
            output.append(max(range(len(logits)), key=logits.__getitem__))
            ids.append(output[-1])
    return output


PENALTIES = [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0, frequency_penalty=-0.5),
    dict(repetition_penalty=0.7, logit_bias=((40, 3.0), (41, -100.0))),
]


def test_penalties_change_the_greedy_text_of_a_repeating_prompt_as_a_token_by_token_reference_does(tiny):
    """One batch: each penalised row gets what the reference writes, differently from the
    unpenalised row beside it, which the penalties leave alone."""
    prompt = [40, 41, 42, 43] * 8
    plain = reference_greedy(tiny.model, prompt, NUM_NEW_TOKENS)
    requests = [greedy("plain", prompt)] + [greedy(f"p{i}", prompt, **options) for i, options in enumerate(PENALTIES)]
    streams = Engine(tiny, EngineConfig(num_kv_blocks=64)).generate(requests)
    assert tokens_of(streams["plain"]) == plain
    for i, options in enumerate(PENALTIES):
        penalised = tokens_of(streams[f"p{i}"])
        assert penalised == penalised_reference_greedy(tiny.model, prompt, NUM_NEW_TOKENS, **options), options
        assert penalised != plain, f"{options} changed nothing"


def test_a_large_repetition_penalty_keeps_greedy_output_from_repeating_a_biased_token(tiny):
    """A +100 bias makes a token the prompt lacks the greedy pick; once it is in the output,
    dividing its logit by a penalty of 1000 leaves it no lead, so it does not come twice."""
    prompt = seeded_prompts(10)[4]
    token = next(t for t in range(3, tiny.config.vocab_size) if t not in prompt)
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    biased = tokens_of(engine.generate([greedy("b", prompt, logit_bias=((token, 100.0),))])["b"])
    assert biased == [token] * NUM_NEW_TOKENS
    penalised = tokens_of(engine.generate([greedy("r", prompt, logit_bias=((token, 100.0),), repetition_penalty=1000.0)])["r"])
    assert penalised[0] == token and token not in penalised[1:]


def test_seeded_sampling_repeats_and_lanes_are_accepted(tiny):
    prompt = seeded_prompts(10)[6]
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    options = dict(temperature=1.0, top_p=0.9, seed=1234)
    runs = [
        tokens_of(
            engine.generate([Request(f"x{i}", tuple(prompt), SamplingOptions(max_tokens=8, ignore_eos=True, **options), lane=Lane.PAID)])[
                f"x{i}"
            ]
        )
        for i in range(2)
    ]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 8


def test_a_seeded_request_whose_id_comes_back_after_it_finished_samples_afresh(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    request = Request("x", tuple(seeded_prompts(10)[6]), SamplingOptions(max_tokens=8, ignore_eos=True, temperature=1.0, seed=7))
    runs = [tokens_of(engine.generate([request])["x"]) for _ in range(2)]
    assert runs[0] == runs[1], "the runner forgot the first one's generator before the second ran"


def test_stats_split_prefill_and_decode_work(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    engine.generate([greedy("a", seeded_prompts(10)[7])])
    stats = engine.stats()
    assert stats.num_prefill_tokens == 64
    assert stats.num_decode_tokens == NUM_NEW_TOKENS - 1
    assert stats.prefill_time_s > 0 and stats.decode_time_s > 0
    assert stats.scheduler.num_used_blocks == 0 and stats.scheduler.num_cached_blocks > 0
    events = engine.drain_kv_events()
    assert events and all(e.kind.value == "stored" for e in events)


def test_a_stop_string_ends_the_reply_and_is_not_shown(tiny):
    prompt = seeded_prompts(10)[6]
    expected = reference_greedy(tiny.model, prompt, NUM_NEW_TOKENS)
    full_text = tiny.tokenizer.decode(expected)
    stop = tiny.tokenizer.decode(expected[4:6])
    assert stop and full_text.index(stop) > 0
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    stream = engine.generate([greedy("s", prompt, stop=(stop,))])["s"]
    assert stream[-1].finish_reason is FinishReason.STOP
    assert "".join(o.text for o in stream) == full_text[: full_text.index(stop)]
    assert len(tokens_of(stream)) < NUM_NEW_TOKENS
    assert engine.kv.num_used_blocks == 0, "a stop string frees the sequence's blocks"


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(temperature=1.0, top_p=0.95, seed=1234),
        dict(temperature=0.8, top_k=50, min_p=0.01, seed=-3),
        dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3),
        dict(temperature=1.0, seed=99, repetition_penalty=1.3, frequency_penalty=1.0, logit_bias=((5, 2.0),)),
    ],
    ids=["greedy", "seeded", "seeded-filtered", "greedy-penalised", "seeded-penalised"],
)
def test_a_reply_continued_on_another_engine_equals_one_generated_in_one_go(tiny, options):
    """The sampler's random state comes from (seed, position), so a continuation (the first
    part's tokens given as generated tokens, on a fresh engine) draws exactly the tokens an
    uninterrupted run does, and their text continues where the first part's ended."""
    prompt = seeded_prompts(10)[6]
    sampling = SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, **options)
    whole = Engine(tiny, EngineConfig(num_kv_blocks=64)).generate([Request("w", tuple(prompt), sampling)])["w"]
    whole_tokens = tokens_of(whole)
    assert len(whole_tokens) == NUM_NEW_TOKENS
    num_first = 5
    first = Engine(tiny, EngineConfig(num_kv_blocks=64)).generate([Request("p", tuple(prompt), replace(sampling, max_tokens=num_first))])[
        "p"
    ]
    first_tokens = tokens_of(first)
    assert first_tokens == whole_tokens[:num_first]
    continued = Engine(tiny, EngineConfig(num_kv_blocks=64)).generate(
        [Request("c", tuple(prompt), sampling, generated_token_ids=tuple(first_tokens))]
    )["c"]
    assert first_tokens + tokens_of(continued) == whole_tokens
    assert continued[-1].num_output_tokens == NUM_NEW_TOKENS and continued[-1].finish_reason is FinishReason.LENGTH
    # What the uninterrupted run streamed after its first part: not the whole text cut at the first
    # part's decoded length, which differs when the cut splits a character's bytes (held back
    # while streaming, decoded as U+FFFD on its own).
    assert [len(o.new_token_ids) for o in whole] == [1] * NUM_NEW_TOKENS
    assert "".join(o.text for o in continued) == "".join(o.text for o in whole[num_first:])


def test_seeded_replies_differ_by_seed_and_batched_neighbours_do_not_change_a_seeded_one(tiny):
    prompt = seeded_prompts(10)[6]

    def seeded(request_id: str, seed: int) -> Request:
        return Request(request_id, tuple(prompt), SamplingOptions(max_tokens=8, ignore_eos=True, temperature=1.0, seed=seed))

    alone = tokens_of(Engine(tiny, EngineConfig(num_kv_blocks=64)).generate([seeded("a", 1)])["a"])
    batched = Engine(tiny, EngineConfig(num_kv_blocks=64)).generate([seeded("a", 1), seeded("b", 2)])
    assert tokens_of(batched["a"]) == alone
    assert tokens_of(batched["b"]) != alone


def test_a_token_id_outside_the_vocabulary_is_refused_at_every_door_and_the_engine_goes_on(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    vocab_size = tiny.config.vocab_size
    bad_prompt = Request("bad", (5, vocab_size, 6), SamplingOptions(max_tokens=2))
    bad_generated = Request("bad-gen", (5, 6), SamplingOptions(max_tokens=4), generated_token_ids=(7, vocab_size + 10))
    for request in (bad_prompt, bad_generated):
        with pytest.raises(TokenIdOutOfRange, match=str(request.prompt_token_ids[1] if request is bad_prompt else vocab_size + 10)):
            engine.check(request)
        with pytest.raises(TokenIdOutOfRange):
            engine.add(request)
        with pytest.raises(TokenIdOutOfRange):
            engine.reserve_import(request, 1)
    assert not engine.has_work()
    prompt = seeded_prompts(10)[4]
    assert tokens_of(engine.generate([greedy("good", prompt)])["good"]) == reference_greedy(tiny.model, prompt, NUM_NEW_TOKENS)
