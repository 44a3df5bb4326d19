"""Pre-quantized FP8 checkpoints (compressed-tensors, as llm-compressor publishes them): a tiny one
written here from random weights loads as it is into Fp8Linear layers, one rank or each rank's
slices, and the engine writes the greedy tokens of a plain model holding the same weights
dequantized; another quantization is refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from reference_model import random_model, reference_greedy, reference_logits, tiny_config, word_tokenizer
from safetensors.torch import save_file
from test_fp8 import same_bits
from test_sharded_loading import expected_slices, load_rank

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.errors import StartupError
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.checkpoint_names import hf_state_dict, load_hf_weights
from tandem.models.compressed_tensors import read_quantization
from tandem.models.config import ModelConfig
from tandem.models.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear, quantize_fp8
from tandem.models.llama import LlamaForCausalLM
from tandem.models.loader import load_model
from tandem.models.safetensors_weights import SHARD_INDEX
from tandem.ops.model_shape import read_model_shape

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_NEW_TOKENS = 10


def quantization_config(strategy: str, static: bool, kv_scales: bool) -> dict[str, Any]:
    """config.json's quantization_config as llm-compressor writes it for FP8 weights."""
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None, "block_structure": None}
    inputs = {**scheme, "strategy": "tensor"} if static else {**scheme, "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**scheme, "strategy": strategy}, "input_activations": inputs}},
        "kv_cache_scheme": {**scheme, "strategy": "tensor"} if kv_scales else None,
    }


def write_fp8_checkpoint(
    config: ModelConfig, folder: Path, strategy: str = "channel", static: bool = False, kv_scales: bool = False
) -> dict[str, torch.Tensor]:
    """A random model's projections quantized to e4m3 (a float32 scale per output row, or one bf16
    scale per tensor), saved one safetensors file per layer with its index, with config.json and
    a tokenizer. Returns the tensors written."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state_dict(random_model(config, seed=0, attention=paged_attention_reference)).items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rpartition(".")[2] not in PROJECTIONS:
            out[name] = tensor
            continue
        if strategy == "channel":
            out[name], scale = quantize_fp8(tensor)
            out[f"{module}.weight_scale"] = scale[:, None]
        else:
            scale = (tensor.abs().amax() / FP8_MAX).bfloat16().float()
            out[name] = (tensor / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[f"{module}.weight_scale"] = scale.reshape(1).bfloat16()
        if static:
            out[f"{module}.input_scale"] = torch.tensor([0.02])
    for layer in range(config.num_layers) if kv_scales else ():
        out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.5 + layer)  # no dimensions, as published
        out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.25)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps({**config.to_hf(), "quantization_config": quantization_config(strategy, static, kv_scales)})
    )
    word_tokenizer(config.vocab_size).backend.save(str(folder / "tokenizer.json"))
    files: dict[str, list[str]] = {}
    for name in out:
        files.setdefault(f"model-{name.split('.')[2] if name.startswith('model.layers.') else 'rest'}.safetensors", []).append(name)
    for file, names in files.items():
        save_file({n: out[n].contiguous() for n in names}, str(folder / file), metadata={"format": "pt"})
    (folder / SHARD_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {n: f for f, names in files.items() for n in names}}))
    return out


def dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint as plain float32 weights: each fp8 weight times its scale, rounded once."""
    out = {}
    for name, tensor in tensors.items():
        if tensor.dtype == FP8_DTYPE:
            out[name] = tensor.float() * tensors[name.removesuffix("weight") + "weight_scale"].float()
        elif not name.endswith(("_scale",)):
            out[name] = tensor
    return out


def fp8_slices(tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s fused fp8 weights, by parameter name, with the scale of each of their rows:
    each scale made a whole (out, in) matrix of its rows' scales, so that the rules of tensor
    parallelism cut it as they cut the weight (a column slice keeps its whole rows' scales)."""
    plain = dequantized(tensors)
    fp8 = {n: t for n, t in tensors.items() if t.dtype == FP8_DTYPE}
    scales = {
        n: tensors[n.removesuffix("weight") + "weight_scale"].float().reshape(-1, 1).expand(t.shape).contiguous() for n, t in fp8.items()
    }
    weights, rows = expected_slices(plain | fp8, config, rank, size), expected_slices(plain | scales, config, rank, size)
    return {name: (weights[name], rows[name][:, 0]) for name in weights if weights[name].dtype == FP8_DTYPE}


def check_fp8_slices(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int) -> None:
    modules = dict(model.named_modules())
    assert sum(isinstance(m, Fp8Linear) for m in modules.values()) == 4 * config.num_layers
    expected = fp8_slices(tensors, config, rank, size)
    assert len(expected) == 4 * config.num_layers
    for name, (weight, scale) in expected.items():
        module = modules[name.removesuffix(".weight")]
        assert isinstance(module, Fp8Linear) and same_bits(module.weight_fp8, weight), f"rank {rank}: {name}"
        assert torch.equal(module.scale, scale), f"rank {rank}: {name}"


@pytest.mark.parametrize("strategy,static", [("channel", False), ("tensor", True)], ids=["channel-dynamic", "tensor-static"])
def test_an_fp8_checkpoint_loads_as_it_is_and_the_engine_matches_its_dequantized_weights(tmp_path: Path, strategy: str, static: bool):
    config = tiny_config(vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False)
    tensors = write_fp8_checkpoint(config, tmp_path, strategy, static)
    loaded = load_model(tmp_path, torch.float32, "cpu", paged_attention_reference, "none", pack=False)  # none: kept fp8 all the same
    check_fp8_slices(loaded.model, tensors, config, 0, 1)

    reference = LlamaForCausalLM(config, paged_attention_reference)
    load_hf_weights(reference, dequantized(tensors).items())
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    torch.testing.assert_close(reference_logits(loaded.model, prompts[0]), reference_logits(reference, prompts[0]), atol=1e-4, rtol=1e-4)
    engine = Engine(loaded, EngineConfig(num_kv_blocks=100, max_num_batched_tokens=64))
    sampling = SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    streams = engine.generate([Request(f"r{i}", tuple(p), sampling) for i, p in enumerate(prompts)])
    written = [[t for out in streams[f"r{i}"] for t in out.new_token_ids] for i in range(len(prompts))]
    assert written == [reference_greedy(reference, p, NUM_NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_each_rank_holds_its_slices_of_an_fp8_checkpoint_with_whole_rows_scales(tmp_path: Path, strategy: str):
    """q/k/v and gate/up rows with their rows' scales (a per-tensor scale of q, k, v each given to its
    rows of the fused qkv); o_proj and down_proj columns with their whole rows' scales."""
    config = tiny_config(attention_bias=True)
    tensors = write_fp8_checkpoint(config, tmp_path, strategy)
    for rank in range(2):
        check_fp8_slices(load_rank(tmp_path, rank, 2, "fp8").model, tensors, config, rank, 2)


def test_kv_cache_scales_go_to_each_attention_layer(tmp_path: Path):
    config = tiny_config()
    write_fp8_checkpoint(config, tmp_path, kv_scales=True)
    model = load_model(tmp_path, torch.float32, "cpu", paged_attention_reference, "fp8", pack=False).model
    assert [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in model.model.layers] == [(0.5, 0.25), (1.5, 0.25)]


@pytest.mark.parametrize(
    "quantization,named",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq', 4-bit"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq', 4-bit"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "format 'pack-quantized'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}},
            },
            "format 'int-quantized'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}},
            },
            "8-bit float weights per block",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise fp8"),
    ],
    ids=["awq", "gptq", "int4-pack", "int8", "fp8-block", "fp8-deepseek"],
)
def test_another_quantization_is_refused_by_name(quantization: dict[str, Any], named: str):
    with pytest.raises(StartupError, match="Tandem does not load") as error:
        read_quantization({"quantization_config": quantization})
    assert named in str(error.value) and "compressed-tensors" in str(error.value)


def test_an_fp8_checkpoint_refuses_int8_and_an_fp8_weight_without_its_scale(tmp_path: Path):
    config = tiny_config()
    write_fp8_checkpoint(config, tmp_path / "ok")
    with pytest.raises(StartupError, match="int8 would requantize"):
        load_model(tmp_path / "ok", torch.float32, "cpu", paged_attention_reference, "int8")
    tensors = write_fp8_checkpoint(config, tmp_path / "unscaled")
    path = tmp_path / "unscaled" / "model-0.safetensors"
    save_file(
        {n: t.contiguous() for n, t in tensors.items() if n.startswith("model.layers.0.") and not n.endswith("o_proj.weight_scale")},
        str(path),
    )
    with pytest.raises(StartupError, match="without a weight_scale.*o_proj"):
        load_model(tmp_path / "unscaled", torch.float32, "cpu", paged_attention_reference, "fp8")


def test_the_capacity_planner_counts_an_fp8_checkpoint_as_fp8(tmp_path: Path):
    write_fp8_checkpoint(tiny_config(), tmp_path)
    assert read_model_shape(tmp_path).dtype == "fp8"
