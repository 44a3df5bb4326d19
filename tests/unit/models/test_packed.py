"""Packed projections (models/packed.py): pack_model swaps every projection (in the model's dtype
or int8) and the logits onto the CPU's packed kernel where it serves the dtype (bf16 with
AVX512-BF16, float32 with AVX2) and leaves the model alone elsewhere, a row's bits are its own in
a call of any size, and the engine's greedy output with a packed model equals the reference
forward's. Each test runs for every dtype the kernel serves on this CPU."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from reference_model import random_model, reference_greedy, reference_logits, tiny_config, word_tokenizer
from torch import nn

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import Lane, SamplingOptions
from tandem.kernels import cpu_extension
from tandem.kernels.attention_cpu import paged_attention_cpu
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.kernels.gemm_choice import BUCKETS, GemmChooser
from tandem.models import layers
from tandem.models.config import ModelConfig
from tandem.models.llama import LlamaForCausalLM, StepCut
from tandem.models.loader import LoadedModel
from tandem.models.packed import CUT_CHECK_LAYERS, PackedDecode, PackedLinear, pack_model
from tandem.models.quant import Int8Linear, quantize_model

NUM_NEW_TOKENS = 12
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _serves(dtype: torch.dtype) -> bool:
    return cpu_extension.load() and bool(torch.ops.tandem.packed_mm_supported(16, 64, dtype, dtype))


DTYPES = [
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(not _serves(torch.bfloat16), reason="bf16 rows need AVX512-BF16")),
    pytest.param(torch.float32, id="fp32", marks=pytest.mark.skipif(not _serves(torch.float32), reason="float32 rows need AVX2 and FMA")),
]
# The kernels a test forces (kernels/gemm_choice.py); where one does not serve (amx without AMX
# or for float32 rows, onednn for int8 weights) pack_model's `auto` choice serves instead.
GEMMS = ["packed", "amx", "onednn"]


def _amx() -> bool:
    return cpu_extension.load() and bool(torch.ops.tandem.packed_mm_amx_supported(64, torch.bfloat16))


def _pack(model: LlamaForCausalLM, gemm: str) -> LlamaForCausalLM:
    return pack_model(model, GemmChooser(gemm))  # type: ignore[arg-type]


# The product against the float64 one: bf16 rows and outputs round at 2^-8, float32 ones at 2^-24.
TOLERANCE = {torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


def _projections(model: LlamaForCausalLM) -> list[nn.Module]:
    return [
        getattr(block, name)
        for layer in model.model.layers
        for block in (layer.self_attn, layer.mlp)
        for name in PROJECTIONS
        if hasattr(block, name)
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", [{}, {"attention_bias": True, "tie_word_embeddings": False}], ids=["tied", "qkv-bias-untied"])
def test_pack_model_packs_every_projection_and_the_logits_with_the_same_values(variant, dtype):
    plain = random_model(tiny_config(**variant), seed=0, attention=paged_attention_reference, dtype=dtype).eval()
    packed = pack_model(copy.deepcopy(plain))
    assert len(_projections(packed)) == 8 and all(isinstance(m, PackedLinear) for m in _projections(packed))
    assert isinstance(packed.logits_packed, torch.Tensor)
    ids = list(range(3, 40))
    got, expected = reference_logits(packed, ids), reference_logits(plain, ids)
    # Another kernel, whose sums round their own way, and bf16 between layers: logits of about 4
    # at most move by a few bf16 steps, never far.
    assert (got - expected).abs().max() <= 0.1 and (got - expected).abs().mean() <= 0.02


def test_pack_model_leaves_a_model_whose_dtype_the_kernel_does_not_serve_alone():
    for dtype in (torch.float16, torch.float64, torch.bfloat16, torch.float32):
        if dtype in (torch.bfloat16, torch.float32) and _serves(dtype):
            continue
        model = pack_model(random_model(tiny_config(), seed=0, attention=paged_attention_reference, dtype=dtype))
        assert not any(isinstance(m, PackedLinear) for m in _projections(model)) and getattr(model, "logits_packed", None) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_model_packs_int8_projections_with_their_scales_and_the_same_values(dtype):
    plain = random_model(tiny_config(attention_bias=True), seed=0, attention=paged_attention_reference, dtype=dtype).eval()
    int8 = quantize_model(plain, "int8")
    packed = pack_model(copy.deepcopy(int8))
    assert all(isinstance(m, PackedLinear) and m.scale is not None and m.weight_packed.dtype == torch.int8 for m in _projections(packed))
    assert isinstance(packed.logits_packed, torch.Tensor)  # the tied embedding stays in the dtype: its logits are packed
    ids = list(range(3, 40))
    got, expected = reference_logits(packed, ids), reference_logits(int8, ids)
    assert (got - expected).abs().max() <= 0.1 and (got - expected).abs().mean() <= 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_packed_int8_layer_computes_the_dequantized_product_with_a_row_s_own_bits(bias, dtype):
    """x @ (w8 * scale).T (+ bias) within the dtype's rounding, each row with the bits it gets
    alone, for calls of the rows a tile widens as it loads (up to 8 bf16, 2 float32) and more
    (widened once)."""
    generator = torch.Generator().manual_seed(3)
    int8 = Int8Linear.from_linear(nn.Linear(576, 960, bias=bias).to(dtype))
    packed = PackedLinear.from_int8(int8)
    x = torch.randn(40, 576, generator=generator).to(dtype)
    with torch.no_grad():
        alone = torch.cat([packed(x[i : i + 1]) for i in range(x.shape[0])])
        for rows in (1, 2, 3, 8, 9, 40):
            out = packed(x[:rows])
            expected = x[:rows].double() @ int8.dequantized_weight().double().T + (int8.bias.double() if bias else 0)
            torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])
            assert torch.equal(out, alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("gemm", GEMMS)
def test_a_packed_projection_gives_a_row_in_a_long_call_the_bits_it_gets_alone(gemm, num_threads, dtype):
    """SmolLM2-135M's four projection shapes, 600 rows (a prefill chunk plus decodes) in one call
    against each row alone, as layers.project calls the layer, through each kernel that serves."""
    if gemm == "amx" and not (_amx() and dtype == torch.bfloat16):
        pytest.skip("the AMX kernel takes bf16 rows on a CPU with AMX-BF16")
    if gemm == "onednn" and dtype == torch.float32:
        pytest.skip("oneDNN's float32 matmul does not keep a row's bits (gemm_choice.keeps_row_bits): auto never picks it")
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        generator = torch.Generator().manual_seed(0)
        for out_features, in_features in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
            linear = PackedLinear.from_linear(nn.Linear(in_features, out_features, bias=False).to(dtype))
            linear.use_kernels((gemm,) * len(BUCKETS))
            x = torch.randn(600, in_features, generator=generator).to(dtype)
            with torch.no_grad():
                batched = layers.project(linear, x)
                alone = torch.cat([layers.project(linear, x[i : i + 1]) for i in range(x.shape[0])])
            assert torch.equal(batched, alone), f"({out_features}, {in_features})"
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", [{}, {"attention_bias": True, "tie_word_embeddings": False}], ids=["tied", "qkv-bias-untied"])
@pytest.mark.parametrize("num_prompts", [3, 24])
@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("gemm", GEMMS)
def test_engine_greedy_output_with_a_packed_model_equals_the_reference(gemm, variant, num_prompts, quantization, dtype):
    """The engine (chunked prefill, decode batches of up to 24 rows) on a packed model (in the
    dtype or int8, through each kernel) writes what the naive reference forward writes on the
    same model packed."""
    config = tiny_config(vocab_size=512, max_position_embeddings=1024, **variant)
    plain = random_model(config, seed=0, attention=paged_attention_reference, dtype=dtype)
    model = _pack(quantize_model(plain, quantization), gemm).eval()
    assert all(isinstance(m, PackedLinear) for m in _projections(model))
    rng = random.Random(num_prompts)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(num_prompts)]
    expected = [reference_greedy(model, p, NUM_NEW_TOKENS) for p in prompts]

    engine = Engine(
        LoadedModel(model, config, word_tokenizer(config.vocab_size)), EngineConfig(num_kv_blocks=400, max_num_batched_tokens=64)
    )
    sampling = SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    streams = engine.generate([Request(f"r{i}", tuple(p), sampling) for i, p in enumerate(prompts)])
    assert [[t for out in streams[f"r{i}"] for t in out.new_token_ids] for i in range(num_prompts)] == expected


def greedy_answers(model: LlamaForCausalLM, config: ModelConfig, fast_decode, batches: list[list[list[int]]]) -> list[list[int]]:
    """Each batch of prompts generated together (free requests, greedy) on one fresh engine with
    `fast_decode` as the model's; every reply's tokens, batch by batch."""
    model.model.fast_decode = fast_decode
    engine = Engine(LoadedModel(model, config, word_tokenizer(config.vocab_size)), EngineConfig(num_kv_blocks=200))
    sampling = SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    answers = []
    for b, batch in enumerate(batches):
        streams = engine.generate([Request(f"b{b}-r{i}", tuple(p), sampling, lane=Lane.FREE) for i, p in enumerate(batch)])
        answers += [[t for out in stream for t in out.new_token_ids] for stream in streams.values()]
    return answers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("gemm", ["packed", "amx"])
def test_a_decode_step_s_layers_in_one_call_give_the_layers_bits(gemm, quantization, dtype):
    """PackedDecode (decode_layers in C++) against the same model's layers run one by one on the
    same step: every decode step of an engine serving prompts together and one alone has the same
    hidden state, bit for bit, and the same cache contents; the greedy output is the layers'."""
    if gemm == "amx" and not (_amx() and dtype == torch.bfloat16):
        pytest.skip("the AMX kernel takes bf16 rows on a CPU with AMX-BF16")
    config = tiny_config(vocab_size=512, max_position_embeddings=1024)
    model = _pack(quantize_model(random_model(config, seed=1, attention=paged_attention_cpu, dtype=dtype), quantization), gemm).eval()
    inner = model.model
    plan = inner.fast_decode
    assert isinstance(plan, PackedDecode)
    compared: list[bool] = []

    def both(h, cos, sin, kv_cache, meta, should_cut=None):
        fast = plan(h, cos, sin, kv_cache, meta, should_cut)
        assert fast is not None
        written = kv_cache.clone()
        slow = h
        for layer, k_cache, v_cache in zip(inner.layers, kv_cache.select(2, 0).unbind(1), kv_cache.select(2, 1).unbind(1), strict=True):
            slow = layer.forward(slow, cos, sin, k_cache, v_cache, meta)  # writes this step's K and V again
        compared.append(torch.equal(fast, slow) and torch.equal(written, kv_cache))
        return fast

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(5)]
    fused = greedy_answers(model, config, both, [prompts, prompts[:1]])
    assert len(compared) >= 2 * (NUM_NEW_TOKENS - 1) and all(compared)
    assert fused == greedy_answers(model, config, None, [prompts, prompts[:1]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_step_that_may_be_cut_runs_a_few_layers_a_call_with_the_one_call_s_bits(dtype, monkeypatch):
    """A decode step of free rows (the engine sets should_cut) runs its layers CUT_CHECK_LAYERS to
    a call and asks between calls: its hidden state and cache contents are the one call's, bit
    for bit, and the greedy answers the layers'; a cut asked for after the first call ends the
    step there with StepCut."""
    config = tiny_config(vocab_size=512, max_position_embeddings=1024, num_layers=2 * CUT_CHECK_LAYERS + 1)
    model = _pack(random_model(config, seed=1, attention=paged_attention_cpu, dtype=dtype), "packed").eval()
    inner = model.model
    plan = inner.fast_decode
    assert isinstance(plan, PackedDecode)
    compared: list[bool] = []
    asked: list[int] = []
    step_args: list[tuple] = []

    def both(h, cos, sin, kv_cache, meta, should_cut=None):
        assert should_cut is not None, "a step of free rows may be cut"
        step_args[:] = [(h, cos, sin, kv_cache, meta)]
        chunked = plan(h, cos, sin, kv_cache, meta, lambda: asked.append(1) or should_cut())
        written = kv_cache.clone()
        whole = plan(h, cos, sin, kv_cache, meta)  # writes this step's K and V again
        assert chunked is not None and whole is not None
        compared.append(torch.equal(chunked, whole) and torch.equal(written, kv_cache))
        return chunked

    rng = random.Random(6)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(3)]
    assert greedy_answers(model, config, both, [prompts]) == greedy_answers(model, config, None, [prompts])
    assert len(compared) == NUM_NEW_TOKENS - 1 and all(compared)
    assert len(asked) == 3 * len(compared), "13 layers: calls of 6, 6 and 1, asked before each"

    calls: list[int] = []
    monkeypatch.setattr(plan, "_layers", lambda h, *rest: calls.append(1) or h)
    with pytest.raises(StepCut):
        plan(*step_args[0], lambda: len(calls) >= 1)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_one_call_decode_sees_a_swapped_module_at_the_next_step(dtype):
    """It keeps the weights list it built; a projection or attention swapped after that is what
    the next step runs (a stale list would decode with the old projection, or the CPU kernels)."""
    config = tiny_config(vocab_size=512, max_position_embeddings=1024)
    model = _pack(random_model(config, seed=1, attention=paged_attention_cpu, dtype=dtype), "packed").eval()
    inner = model.model
    plan = inner.fast_decode
    assert isinstance(plan, PackedDecode)
    calls: list[bool] = []

    def counted(*args):
        out = plan(*args)
        calls.append(out is not None)
        return out

    def greedy(fast_decode) -> list[int]:
        inner.fast_decode = fast_decode
        engine = Engine(LoadedModel(model, config, word_tokenizer(config.vocab_size)), EngineConfig(num_kv_blocks=64))
        outputs = engine.generate([Request("r", (5, 6, 7, 8), SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True))])
        return [t for out in outputs["r"] for t in out.new_token_ids]

    before = greedy(counted)
    assert calls and all(calls), "the one call ran"
    other = random_model(config, seed=2, attention=paged_attention_cpu, dtype=dtype).model.layers[0].self_attn.o_proj
    inner.layers[0].self_attn.o_proj = PackedLinear.from_linear(other)
    swapped = greedy(counted)
    assert swapped != before, "the swap changes the answer (else this test could not tell)"
    assert swapped == greedy(None), "the one call ran the swapped projection"
    calls.clear()
    for layer in inner.layers:
        layer.self_attn.attention = paged_attention_reference
    greedy(counted)
    assert calls and not any(calls), "declined once attention is not the CPU kernels'"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_one_call_decode_declines_what_it_does_not_run(dtype):
    """A projection with a bias, or attention other than the CPU kernels', leaves the step to the
    layers as written."""
    config = tiny_config(attention_bias=True)
    model = _pack(random_model(config, seed=0, attention=paged_attention_cpu, dtype=dtype), "packed").eval()
    engine = Engine(LoadedModel(model, config, word_tokenizer(config.vocab_size)), EngineConfig(num_kv_blocks=64))
    declined: list[bool] = []
    plan = model.model.fast_decode
    assert plan is not None
    model.model.fast_decode = lambda *args: declined.append(plan(*args) is None)  # type: ignore[func-returns-value]
    engine.generate([Request("r", (5, 6, 7), SamplingOptions(max_tokens=4, ignore_eos=True))])
    assert declined and all(declined)

    plain = pack_model(random_model(tiny_config(), seed=0, attention=paged_attention_reference, dtype=dtype)).eval()
    model_plan = plain.model.fast_decode
    assert model_plan is not None
    engine = Engine(LoadedModel(plain, tiny_config(), word_tokenizer(512)), EngineConfig(num_kv_blocks=64))
    declined.clear()
    plain.model.fast_decode = lambda *args: declined.append(model_plan(*args) is None)  # type: ignore[func-returns-value]
    engine.generate([Request("r", (5, 6, 7), SamplingOptions(max_tokens=4, ignore_eos=True))])
    assert declined and all(declined)
