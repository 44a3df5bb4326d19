"""The paged forward computes exactly what the naive dense forward computes, however the engine
chunks prompts, interleaves sequences and scatters their blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference_model import one_prefill, random_model, reference_logits, tiny_config

from tandem.kernels import cpu_extension
from tandem.kernels.attention_reference import paged_attention_reference

TIGHT = dict(atol=2e-5, rtol=1e-5)  # float32: only summation order differs


def _tokens(seed: int, count: int, vocab_size: int) -> list[int]:
    return torch.randint(3, vocab_size, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "variant",
    [{}, {"tie_word_embeddings": False}, {"attention_bias": True}, {"num_kv_heads": 4}],
    ids=["tied-gqa", "untied", "qkv-bias", "mha"],
)
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_interleaved_paged_forward_matches_dense_reference(variant, block_size, paged_runner, paged_sequence):
    config = dataclasses.replace(tiny_config(), **variant)
    model = random_model(config, seed=0, attention=paged_attention_reference)
    runner = paged_runner(model, num_blocks=24, block_size=block_size)
    # Prompt A (21 tokens) in chunks of 13 and 8, prompt B (6) whole in the first step, then both
    # decode together for 4 steps. Blocks are scattered, out of order, interleaved between A and B.
    a = paged_sequence(_tokens(1, 21 + 4, config.vocab_size), block_ids=[17, 3, 11, 0, 22, 8, 5][: -(-25 // block_size)])
    b = paged_sequence(_tokens(2, 6 + 5, config.vocab_size), block_ids=[9, 20, 1][: -(-11 // block_size)])
    plan = [[(a, 13), (b, 6)], [(a, 8), (b, 1)]] + [[(b, 1), (a, 1)]] * 4
    logits: dict[int, list[torch.Tensor]] = {id(a): [], id(b): []}
    for work in plan:
        for (seq, _), out in zip(work, runner.step(work), strict=True):
            logits[id(seq)].append(out)

    for seq in (a, b):
        torch.testing.assert_close(torch.cat(logits[id(seq)]), reference_logits(model, seq.token_ids), **TIGHT)


def test_decode_reads_the_prompt_back_from_the_cache(paged_runner, paged_sequence):
    """Guards the test above: if a decode ignored the cached prompt, corrupting it would not matter."""
    model = random_model(tiny_config(), seed=0, attention=paged_attention_reference)
    runner = paged_runner(model, num_blocks=8, block_size=4)
    seq = paged_sequence(_tokens(3, 9, model.config.vocab_size), block_ids=[5, 2, 7])
    runner.step([(seq, 8)])
    runner.kv_cache[2] = 0.0  # prompt positions 4..7
    corrupted = runner.step([(seq, 1)])[0]
    assert not torch.allclose(corrupted, reference_logits(model, seq.token_ids)[-1:], atol=1e-3)


def test_positions_matter(paged_runner, paged_sequence):
    """The same tokens at shifted positions give different logits: rotary is applied."""
    model = random_model(tiny_config(), seed=0, attention=paged_attention_reference)
    tokens = _tokens(4, 6, model.config.vocab_size)
    logits = reference_logits(model, tokens)
    shifted = reference_logits(model, [tokens[0], *tokens])[1:]
    assert not torch.allclose(logits[1:], shifted[1:], atol=1e-3)


def test_random_model_logits_are_spread_and_seeded():
    config = tiny_config()
    first = reference_logits(random_model(config, seed=7, attention=paged_attention_reference), [5, 6, 7])
    again = reference_logits(random_model(config, seed=7, attention=paged_attention_reference), [5, 6, 7])
    other = reference_logits(random_model(config, seed=8, attention=paged_attention_reference), [5, 6, 7])
    assert torch.equal(first, again) and not torch.equal(first, other)
    top2 = first.topk(2, dim=-1).values
    assert first.std() > 0.5 and (top2[:, 0] - top2[:, 1]).min() > 1e-3


def test_bf16_model_keeps_a_float32_rotary_table():
    model = random_model(tiny_config(), seed=0, attention=paged_attention_reference, dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.cos_sin.dtype == torch.float32
    fp32 = random_model(tiny_config(), seed=0, attention=paged_attention_reference)
    torch.testing.assert_close(model.model.rotary_emb.cos_sin, fp32.model.rotary_emb.cos_sin, atol=0, rtol=0)


def test_kv_cache_scales_fold_around_attention_and_keep_the_one_call_decode_off(paged_runner, paged_sequence):
    """A layer's fp8 KV scales (a checkpoint's k_scale, v_scale): the cache holds k / k_scale and
    v / v_scale and the output is the unscaled model's, up to rounding; the CPU's one-call decode,
    which applies no scales, is not used for such a model."""
    from tandem.kernels import cpu_extension
    from tandem.models.packed import pack_model

    config = tiny_config()
    plain = random_model(config, seed=11, attention=paged_attention_reference)
    scaled = random_model(config, seed=11, attention=paged_attention_reference)
    for layer, (k_scale, v_scale) in zip(scaled.model.layers, [(0.5, 0.25), (4.0, 2.0)], strict=True):
        layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale, v_scale
    tokens = _tokens(3, 20, config.vocab_size)
    outputs, caches = [], []
    for model in (plain, scaled):
        runner = paged_runner(model, num_blocks=8, block_size=4)
        seq = paged_sequence(token_ids=list(tokens), block_ids=[3, 1, 6, 0, 5])
        outputs.append(torch.cat([runner.step([(seq, 12)])[0], runner.step([(seq, 8)])[0]]))
        caches.append(runner.kv_cache)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=0)
    # layer 0's cached K is the plain model's halved, its V the plain's quartered (block 3 holds positions 0-3)
    torch.testing.assert_close(caches[1][3, 0, 0], caches[0][3, 0, 0] / 0.5, atol=0, rtol=1e-6)
    torch.testing.assert_close(caches[1][3, 0, 1], caches[0][3, 0, 1] / 0.25, atol=0, rtol=1e-6)
    if cpu_extension.load():
        assert pack_model(plain).model.fast_decode is not None
        assert pack_model(scaled).model.fast_decode is None


@pytest.mark.skipif(not cpu_extension.load(), reason="needs the C++ CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cpu_layers_with_each_residual_add_fused_into_the_next_norm_give_the_plain_loops_bits(dtype: torch.dtype) -> None:
    config = tiny_config(vocab_size=128, max_position_embeddings=64)
    model = random_model(config, seed=1, attention=paged_attention_reference).to(dtype).model
    ids, positions, kv_cache, meta = one_prefill(config, 20, dtype)
    with torch.inference_mode():
        fused_cache = kv_cache.clone()
        fused = model(ids, positions, fused_cache, meta)  # the CPU's fused path
        h = model.embed(ids)
        cos, sin = model.rotary_emb(positions)
        plain_cache = kv_cache.clone()
        for layer, k_cache, v_cache in zip(
            model.layers, plain_cache.select(2, 0).unbind(1), plain_cache.select(2, 1).unbind(1), strict=True
        ):
            h = layer.forward(h, cos, sin, k_cache, v_cache, meta)
        plain = model.norm(h)
    assert fused.dtype == dtype and torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)
