"""Weight-only int8: the layer computes x @ (int8 * scale).T on both of its paths, the engine with an
int8 model writes exactly what a naive forward over the dequantized weights writes, the weights take
about half the bytes of bf16, and an int8 worker is served under its own name."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from reference_model import (
    dequantized_copy,
    random_model,
    reference_greedy,
    reference_logits,
    save_safetensors_folder,
    tiny_config,
    word_tokenizer,
)
from torch import nn

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.files import EMBEDDED_MODEL_NAME, open_model
from tandem.models.llama import LlamaForCausalLM
from tandem.models.loader import LoadedModel, load_model
from tandem.models.quant import INT8_KERNEL_MAX_ROWS, Int8Linear, quantize_int8, quantize_model

NUM_NEW_TOKENS = 12
QUANTIZED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight[3] = 0.0  # an all-zero row must not divide by zero
        linear.weight[5, 7] = 4.0  # an outlier sets its row's scale alone
    return linear.to(dtype)


def test_int8_values_times_scales_reproduce_the_weight_within_half_a_step():
    weight = _linear(96, 40, bias=False, dtype=torch.float32).weight.detach()
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.shape == (40,)
    assert q.abs().amax(dim=1).tolist() == [0 if row == 3 else 127 for row in range(40)], "each row's largest value maps to ±127"
    error = (q.float() * scale[:, None] - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(q[3], torch.zeros(96, dtype=torch.int8)) and scale[3] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_rows", [1, 5, INT8_KERNEL_MAX_ROWS, INT8_KERNEL_MAX_ROWS + 1, 70], ids=lambda n: f"{n}-rows")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_int8_linear_equals_its_dequantized_reference(dtype, num_rows, bias):
    layer = Int8Linear.from_linear(_linear(96, 40, bias, dtype))
    x = torch.randn(num_rows, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = x.float() @ (layer.weight_int8.float() * layer.scale.float()[:, None]).T
    if bias:
        expected = expected + layer.bias.float()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (num_rows, 40)
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected, **tolerance)


def test_int8_linear_takes_3d_and_non_contiguous_input_and_fp32_activations_on_a_bf16_layer():
    layer = Int8Linear.from_linear(_linear(96, 40, False, torch.bfloat16))
    x = torch.randn(96, 6).T.reshape(2, 3, 96)  # not contiguous in its last dimension
    out = layer(x)
    assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16
    reference = x.to(torch.bfloat16).float() @ layer.dequantized_weight().float().T
    torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True, "tie_word_embeddings": False}], ids=["tied", "qkv-bias-untied"])
@pytest.mark.parametrize("num_prompts", [3, 24], ids=["kernel-decode", "cast-decode"])
def test_engine_greedy_output_with_int8_weights_equals_the_dequantized_reference(variant, num_prompts):
    """3 prompts decode through the fused kernel; 24 decode above INT8_KERNEL_MAX_ROWS, through the
    cast path; prefill chunks always take the cast path."""
    config = tiny_config(vocab_size=512, max_position_embeddings=1024, **variant)
    model = quantize_model(random_model(config, seed=0, attention=paged_attention_reference), "int8").eval()
    reference = dequantized_copy(model).eval()
    rng = random.Random(num_prompts)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(num_prompts)]
    expected = [reference_greedy(reference, p, NUM_NEW_TOKENS) for p in prompts]

    engine = Engine(
        LoadedModel(model, config, word_tokenizer(config.vocab_size)), EngineConfig(num_kv_blocks=400, max_num_batched_tokens=64)
    )
    sampling = SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    streams = engine.generate([Request(f"r{i}", tuple(p), sampling) for i, p in enumerate(prompts)])
    assert [[t for out in streams[f"r{i}"] for t in out.new_token_ids] for i in range(num_prompts)] == expected


def test_int8_changes_the_output_of_the_plain_model():
    """Guards the test above: the reference is the dequantized model, not the original one, and
    the two differ (else int8 would not be tested at all)."""
    plain = random_model(tiny_config(), seed=0, attention=paged_attention_reference)
    quantized = quantize_model(copy.deepcopy(plain), "int8")
    ids = list(range(3, 20))
    assert not torch.equal(reference_logits(plain, ids), reference_logits(quantized, ids))


def _linear_weight_bytes(model: LlamaForCausalLM) -> int:
    total = 0
    for layer in model.model.layers:
        for name in QUANTIZED:
            module = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            total += sum(t.nbytes for t in [*module.parameters(), *module.buffers()])
    return total


def test_int8_projection_weights_take_about_half_the_bytes_of_bf16_and_the_rest_stays_bf16():
    config = tiny_config(hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4, head_dim=32)
    bf16 = random_model(config, seed=0, attention=paged_attention_reference, dtype=torch.bfloat16)
    bf16_bytes = _linear_weight_bytes(bf16)
    int8 = quantize_model(bf16, "int8")
    ratio = _linear_weight_bytes(int8) / bf16_bytes
    assert 0.5 <= ratio < 0.52, f"int8 projections take {ratio:.3f} of bf16's bytes"
    layer = int8.model.layers[0]
    assert all(isinstance(getattr(layer.self_attn, n, None) or getattr(layer.mlp, n), Int8Linear) for n in QUANTIZED)
    assert int8.model.embed_tokens.weight.dtype == torch.bfloat16 and layer.input_layernorm.weight.dtype == torch.bfloat16
    assert next(int8.parameters()).dtype == torch.bfloat16, "the engine reads the model's dtype from its first parameter"


def test_load_model_quantizes_the_projections_it_loaded_only_when_asked(tmp_path):
    original = random_model(tiny_config(), seed=0, attention=paged_attention_reference)
    save_safetensors_folder(original, tmp_path)
    word_tokenizer(original.config.vocab_size).backend.save(str(tmp_path / "tokenizer.json"))
    plain = load_model(tmp_path, torch.float32, "cpu", paged_attention_reference, pack=False)
    int8 = load_model(tmp_path, torch.float32, "cpu", paged_attention_reference, "int8", pack=False)  # packing: test_packed.py
    assert not any(isinstance(m, Int8Linear) for m in plain.model.modules())
    assert sum(isinstance(m, Int8Linear) for m in int8.model.modules()) == 4 * int8.config.num_layers
    ids = list(range(3, 40))
    expected = reference_logits(quantize_model(original, "int8"), ids)
    torch.testing.assert_close(reference_logits(int8.model, ids), expected, atol=0, rtol=0)


def test_an_int8_model_without_a_served_name_is_served_as_the_file_name_with_int8(tmp_path):
    folder = tmp_path / "tiny-llama"
    save_safetensors_folder(random_model(tiny_config(), seed=0, attention=paged_attention_reference), folder)
    assert open_model(folder).name == "tiny-llama"
    assert open_model(folder, quantization="int8").name == "tiny-llama-int8"
    assert open_model(folder, served_name="small", quantization="int8").name == "small"
    assert open_model(None, quantization="int8").name == f"{EMBEDDED_MODEL_NAME}-int8"
    assert open_model(None, quantization="int8").quantization == "int8"
    assert open_model(None).quantization == "none"
