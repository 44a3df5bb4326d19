"""Weight-only FP8 (--quantization fp8): e4m3 rows times a float32 scale per row reproduce the
weight to e4m3's precision, the layer computes x @ (fp8 * scale).T on the CPU kernel and the torch
fallback alike, the engine with fp8 weights writes the greedy tokens of a plain model holding the
dequantized weights, and the loader quantizes each slice as it reads it (tensor parallelism too)."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from reference_model import random_model, reference_greedy, reference_logits, save_safetensors_folder, tiny_config, word_tokenizer
from test_sharded_loading import expected_slices, load_rank, write_sharded_checkpoint
from torch import nn

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import cpu_extension
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.files import open_model
from tandem.models.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear, quantize_fp8, scaled_mm
from tandem.models.llama import LlamaForCausalLM
from tandem.models.loader import LoadedModel, load_model
from tandem.models.packed import pack_model
from tandem.models.quant import quantize_model

NUM_NEW_TOKENS = 12
needs_kernel = pytest.mark.skipif(
    not (cpu_extension.load() and torch.ops.tandem.fp8_mm_supported(1, 64, torch.float32)), reason="fp8_mm needs AVX512F"
)


def dequantized_fp8_copy(model: LlamaForCausalLM, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A plain model (nn.Linear everywhere) whose projections hold fp8 * scale rounded to `dtype`."""
    plain = copy.deepcopy(model)
    with torch.no_grad():
        for module in list(plain.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, Fp8Linear):
                    linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, dtype=dtype)
                    linear.weight.copy_(child.dequantized_weight(dtype))
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                    setattr(module, name, linear)
    assert not any(isinstance(m, Fp8Linear) for m in plain.modules())
    return plain


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, which fp8 tensors do not take, on their bytes."""
    if a.dtype == FP8_DTYPE and b.dtype == FP8_DTYPE:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a.dtype == b.dtype and torch.equal(a, b)


def _weight(out_features: int = 40, in_features: int = 96) -> torch.Tensor:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0  # an all-zero row must not divide by zero
    weight[5, 7] = 40.0  # an outlier sets its row's scale alone
    weight[6, :4] = 1e-6  # e4m3's subnormals
    return weight


def test_fp8_values_times_scales_reproduce_the_weight_to_e4m3s_precision():
    weight = _weight()
    q, scale = quantize_fp8(weight)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (40,)
    assert q.float().abs().amax(dim=1).tolist() == [0.0 if row == 3 else FP8_MAX for row in range(40)], "each row's absmax maps to ±448"
    # 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 (subnormals) steps are 2^-9
    error = (q.float() * scale[:, None] - weight).abs()
    assert (error <= weight.abs() / 16 + scale[:, None] * 2**-10 + 1e-12).all()
    assert torch.equal(q[3].float(), torch.zeros(96)) and scale[3] == 1.0


@needs_kernel
def test_the_kernel_widens_every_finite_fp8_value_exactly_and_gives_a_row_its_bits_in_any_company():
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    finite = values[~values.float().isnan()]  # 254: e4m3fn has no infinities, two NaNs
    weight = torch.cat([finite, finite.new_zeros(2)]).reshape(16, 16).contiguous()
    out = torch.ops.tandem.fp8_mm(torch.eye(16), weight, torch.ones(16))
    assert torch.equal(out.T, weight.float())
    q, scale = quantize_fp8(_weight(40, 96))
    x = torch.randn(13, 96).bfloat16()
    alone = torch.cat([torch.ops.tandem.fp8_mm(x[i : i + 1], q, scale) for i in range(13)])
    assert torch.equal(torch.ops.tandem.fp8_mm(x, q, scale), alone)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32-kernel", "bf16-kernel", "fp16-fallback"]
)  # the kernel takes float32 and bf16 rows; float16 goes through the dequantized weight
@pytest.mark.parametrize("num_rows", [1, 5, 70], ids=lambda n: f"{n}-rows")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fp8_linear_equals_its_dequantized_reference(dtype, num_rows, bias):
    linear = nn.Linear(96, 40, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(_weight())
    layer = Fp8Linear.from_linear(linear.to(dtype))
    x = torch.randn(num_rows, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = x.float() @ (layer.weight_fp8.float() * layer.scale[:, None]).T
    if bias:
        expected = expected + layer.bias.float()
    out = layer(x.reshape(1, num_rows, 96))
    assert out.dtype == dtype and out.shape == (1, num_rows, 40)
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.25, rtol=2e-2)  # outputs to ±100
    torch.testing.assert_close(out[0].float(), expected, **tolerance)


def test_the_per_tensor_scaled_mm_form_stays_near_the_dequantized_product():
    """The GPU path's form for compute capability 8.9 (fp8 rows times fp8 weights, both scales on
    the float32 output), run by torch's CPU _scaled_mm; the row-wise form needs a 9.0 GPU
    (test_fp8_cuda.py)."""
    weight_fp8, scale = quantize_fp8(_weight(48, 96))
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = scaled_mm(x, weight_fp8, scale, rowwise=False)
    expected = x.float() @ (weight_fp8.float() * scale[:, None]).T
    assert out.dtype == torch.bfloat16
    # the rows' own e4m3 rounding, 2^-4 of each value at most, mostly averaging out over 96 terms
    assert ((out.float() - expected).abs().amax() / expected.abs().amax()) < 0.03


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True, "tie_word_embeddings": False}], ids=["tied", "qkv-bias-untied"])
def test_engine_greedy_output_with_fp8_weights_equals_the_dequantized_reference(variant):
    """The engine's fp8 model (the kernel, in float32) against a naive forward over the weights
    fp8 * scale: the same greedy tokens, logits within 1e-4."""
    config = tiny_config(vocab_size=512, max_position_embeddings=1024, **variant)
    model = quantize_model(random_model(config, seed=0, attention=paged_attention_reference), "fp8").eval()
    reference = dequantized_fp8_copy(model).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(5)]
    expected = [reference_greedy(reference, p, NUM_NEW_TOKENS) for p in prompts]
    torch.testing.assert_close(reference_logits(model, prompts[0]), reference_logits(reference, prompts[0]), atol=1e-4, rtol=1e-4)

    engine = Engine(
        LoadedModel(model, config, word_tokenizer(config.vocab_size)), EngineConfig(num_kv_blocks=200, max_num_batched_tokens=64)
    )
    sampling = SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    streams = engine.generate([Request(f"r{i}", tuple(p), sampling) for i, p in enumerate(prompts)])
    assert [[t for out in streams[f"r{i}"] for t in out.new_token_ids] for i in range(len(prompts))] == expected


def test_fp8_changes_the_output_of_the_plain_model():
    """Guards the test above: the reference is the dequantized model, not the original one."""
    plain = random_model(tiny_config(), seed=0, attention=paged_attention_reference)
    quantized = quantize_model(copy.deepcopy(plain), "fp8")
    ids = list(range(3, 20))
    assert not torch.equal(reference_logits(plain, ids), reference_logits(quantized, ids))


def test_fp8_projections_take_about_half_the_bytes_of_bf16_and_stay_unpacked():
    config = tiny_config(hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4, head_dim=32)
    bf16 = random_model(config, seed=0, attention=paged_attention_reference, dtype=torch.bfloat16)

    def projection_bytes(model: LlamaForCausalLM) -> int:
        return sum(
            t.nbytes
            for layer in model.model.layers
            for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for t in [*module.parameters(), *module.buffers()]
        )

    bf16_bytes = projection_bytes(bf16)
    fp8 = pack_model(quantize_model(bf16, "fp8"))
    assert 0.5 <= projection_bytes(fp8) / bf16_bytes < 0.52
    assert sum(isinstance(m, Fp8Linear) for m in fp8.modules()) == 4 * config.num_layers, "packing leaves fp8 layers as they are"
    assert next(fp8.parameters()).dtype == torch.bfloat16


def test_load_model_quantizes_to_fp8_as_it_loads_what_quantize_model_makes(tmp_path: Path):
    original = random_model(tiny_config(), seed=0, attention=paged_attention_reference)
    save_safetensors_folder(original, tmp_path)
    word_tokenizer(original.config.vocab_size).backend.save(str(tmp_path / "tokenizer.json"))
    loaded = load_model(tmp_path, torch.float32, "cpu", paged_attention_reference, "fp8", pack=False)
    assert sum(isinstance(m, Fp8Linear) for m in loaded.model.modules()) == 4 * loaded.config.num_layers
    reference = quantize_model(original, "fp8")
    buffers = dict(loaded.model.named_buffers())
    for name, tensor in reference.named_buffers():
        assert same_bits(buffers[name], tensor), name
    assert open_model(tmp_path, quantization="fp8").name == f"{tmp_path.name}-fp8"


@pytest.mark.parametrize("size", [2])
def test_fp8_quantizes_each_rank_s_slice_as_it_loads(tmp_path: Path, size: int):
    """Row slices (q/k/v, gate/up) and column slices (o_proj, down_proj: each row's share of the
    rank, quantized alone, as int8's are) of a sharded checkpoint, quantized from the checkpoint's
    float32 values, not the model's bf16."""
    config = tiny_config(attention_bias=True)
    weights = write_sharded_checkpoint(config, tmp_path)
    for rank in range(size):
        model = load_rank(tmp_path, rank, size, "fp8", torch.bfloat16).model
        modules = dict(model.named_modules())
        assert not any(isinstance(m, nn.Linear) for m in modules.values()), "no projection was ever held in bf16"
        for name, tensor in expected_slices(weights, config, rank, size).items():
            module_name, _, kind = name.rpartition(".")
            module = modules[module_name]
            if isinstance(module, Fp8Linear) and kind == "weight":
                weight_fp8, scale = quantize_fp8(tensor)
                assert same_bits(module.weight_fp8, weight_fp8) and torch.equal(module.scale, scale), name
            else:
                assert torch.equal(getattr(module, kind), tensor.bfloat16()), name
