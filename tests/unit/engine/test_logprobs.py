"""Logprobs: the model's own log-probabilities (before the request's logits processors) of the
sampled token and the likeliest alternatives, only for the rows that ask; a continuation carries
them for the tokens it generates."""

from __future__ import annotations

import pytest
import torch
from reference_model import random_model, reference_hidden, tiny_config
from test_engine import NUM_NEW_TOKENS, byte_level_tokenizer, seeded_prompts

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.logprobs import token_logprobs
from tandem.engine.sequence import SamplingOptions, Sequence
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.loader import LoadedModel


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    config = tiny_config(vocab_size=512, max_position_embeddings=1024)
    model = random_model(config, seed=0, attention=paged_attention_reference)
    return LoadedModel(model=model.eval(), config=config, tokenizer=byte_level_tokenizer(config.vocab_size))


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's raw logits for the token after `ids`, by a one-sequence forward."""
    with torch.inference_mode():
        return torch.log_softmax(model.compute_logits(reference_hidden(model, ids)[-1:])[0].float(), dim=-1)


def test_only_the_rows_that_ask_get_logprobs_each_its_own_number_of_alternatives():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    options = [SamplingOptions(top_logprobs=3), SamplingOptions(), SamplingOptions(top_logprobs=0), SamplingOptions(top_logprobs=20)]
    seqs = [Sequence(f"s{i}", (0,), o) for i, o in enumerate(options)]
    tokens = torch.tensor([5, 6, 7, 8])
    answers = token_logprobs(logits, seqs, tokens)
    assert sorted(answers) == [0, 2, 3]
    expected = torch.log_softmax(logits, dim=-1)
    for row, k in ((0, 3), (2, 0), (3, 20)):
        assert answers[row].logprob == pytest.approx(expected[row, tokens[row]].item(), abs=1e-6)
        ids = [token for token, _ in answers[row].top]
        assert ids == expected[row].argsort(descending=True)[:k].tolist()
        assert [lp for _, lp in answers[row].top] == pytest.approx(expected[row, ids].tolist(), abs=1e-6)
    assert token_logprobs(logits, [seqs[1]] * 4, tokens) == {}, "a batch where no row asks gets none"


def test_a_sampled_tokens_logprob_is_the_models_log_softmax_before_bias_penalties_and_temperature(tiny):
    """In one batch: a greedy row (its token first in its top list, with its own logprob), a hot
    sampled row with a logit_bias and a penalty (its logprobs are still the raw model's), and a
    row that asks for nothing (it gets none)."""
    prompt = seeded_prompts(10)[5]
    biased = 300
    asks = dict(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, top_logprobs=5)
    requests = [
        Request("greedy", tuple(prompt), SamplingOptions(**asks)),
        Request(
            "hot", tuple(prompt), SamplingOptions(temperature=2.0, seed=7, logit_bias=((biased, 100.0),), repetition_penalty=1.3, **asks)
        ),
        Request("plain", tuple(prompt), SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)),
    ]
    streams = Engine(tiny, EngineConfig(num_kv_blocks=64)).generate(requests)
    assert all(output.logprobs is None for output in streams["plain"])
    for request_id in ("greedy", "hot"):
        ids = list(prompt)
        for output in streams[request_id]:
            (token,) = output.new_token_ids
            answer = output.logprobs
            assert answer is not None and len(answer.top) == 5
            expected = reference_logprobs(tiny.model, ids)
            assert answer.logprob == pytest.approx(expected[token].item(), abs=2e-3)
            top_ids = [t for t, _ in answer.top]
            assert top_ids == expected.topk(5).indices.tolist()
            values = [lp for _, lp in answer.top]
            assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
            if request_id == "greedy":
                assert answer.top[0] == (token, answer.logprob)
            ids.append(token)
    # The bias makes every hot token the biased one, yet its logprob stays the model's (unlikely).
    assert [t for output in streams["hot"] for t in output.new_token_ids] == [biased] * NUM_NEW_TOKENS
    assert all(output.logprobs is not None and output.logprobs.logprob < -1.0 for output in streams["hot"])


def test_a_continued_reply_carries_logprobs_for_the_tokens_it_generates(tiny):
    prompt = seeded_prompts(10)[3]
    sampling = SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, top_logprobs=2)
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    whole = engine.generate([Request("whole", tuple(prompt), sampling)])["whole"]
    generated = tuple(t for output in whole[:4] for t in output.new_token_ids)
    continued = engine.generate([Request("rest", tuple(prompt), sampling, generated_token_ids=generated)])["rest"]
    assert [o.new_token_ids for o in continued] == [o.new_token_ids for o in whole[4:]]
    for before, after in zip(whole[4:], continued):
        assert after.logprobs is not None and before.logprobs is not None
        assert after.logprobs.logprob == pytest.approx(before.logprobs.logprob, abs=2e-3)
        assert [t for t, _ in after.logprobs.top] == [t for t, _ in before.logprobs.top]
