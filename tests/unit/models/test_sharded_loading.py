"""Every rank of a tensor-parallel group loads exactly its slices of a checkpoint (sharded
safetensors or GGUF), reading no more than those slices, and int8 quantizes each slice as it
arrives. Ranks are loaded one after another in this process: loading does no collectives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from reference_model import random_model, tiny_config, word_tokenizer
from safetensors.torch import save_file
from test_gguf_loading import write_gguf

from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.checkpoint_names import TensorSource, hf_state_dict, load_tensors
from tandem.models.config import ModelConfig
from tandem.models.llama import LlamaForCausalLM
from tandem.models.loader import LoadedModel, load_model
from tandem.models.quant import Int8Linear, quantize_int8, quantize_model
from tandem.models.safetensors_weights import SHARD_INDEX, read_safetensors
from tandem.models.tensor_parallel import Shard, TensorParallel

CONFIGS = {
    # vocab 510 over 4 ranks: 128 rows each, the last rank's 2 of them padding
    "llama": tiny_config(vocab_size=510, tie_word_embeddings=False),
    "qwen2": tiny_config(attention_bias=True, tie_word_embeddings=True),
    "one-kv-head": tiny_config(num_kv_heads=1, tie_word_embeddings=False),  # replicated on every rank
}


def write_sharded_checkpoint(config: ModelConfig, folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random model saved as Hugging Face does a big one: one safetensors file per layer (and one
    for the rest), listed in model.safetensors.index.json. Returns its tensors by name."""
    weights = hf_state_dict(random_model(config, seed=seed, attention=paged_attention_reference))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_hf()))
    word_tokenizer(config.vocab_size).backend.save(str(folder / "tokenizer.json"))
    files: dict[str, list[str]] = {}
    for name in weights:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        files.setdefault(f"model-{layer}.safetensors", []).append(name)
    for file, names in files.items():
        save_file({n: weights[n] for n in names}, str(folder / file), metadata={"format": "pt"})
    weight_map = {n: file for file, names in files.items() for n in names}
    (folder / SHARD_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weights


def expected_slices(weights: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s parameters, cut from the whole checkpoint by the rules of tensor parallelism,
    written out here without the loader's tables."""
    d = config.head_dim
    per_q = config.num_heads // size
    q = slice(rank * per_q * d, (rank + 1) * per_q * d)
    if config.num_kv_heads >= size:
        per_kv = config.num_kv_heads // size
        kv = slice(rank * per_kv * d, (rank + 1) * per_kv * d)
    else:
        head = rank * config.num_kv_heads // size
        kv = slice(head * d, (head + 1) * d)
    per_m = config.intermediate_size // size
    m = slice(rank * per_m, (rank + 1) * per_m)
    rows = -(-config.vocab_size // size)

    def vocab(matrix: torch.Tensor) -> torch.Tensor:
        mine = matrix[rank * rows : (rank + 1) * rows]
        return torch.cat([mine, mine.new_zeros(rows - mine.shape[0], mine.shape[1])])

    out = {"model.embed_tokens.weight": vocab(weights["model.embed_tokens.weight"]), "model.norm.weight": weights["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = vocab(weights["lm_head.weight"])
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        w = {name.removeprefix(p + "."): t for name, t in weights.items() if name.startswith(p + ".")}
        out[f"{p}.self_attn.qkv_proj.weight"] = torch.cat(
            [w["self_attn.q_proj.weight"][q], w["self_attn.k_proj.weight"][kv], w["self_attn.v_proj.weight"][kv]]
        )
        if config.attention_bias:
            out[f"{p}.self_attn.qkv_proj.bias"] = torch.cat(
                [w["self_attn.q_proj.bias"][q], w["self_attn.k_proj.bias"][kv], w["self_attn.v_proj.bias"][kv]]
            )
        out[f"{p}.self_attn.o_proj.weight"] = w["self_attn.o_proj.weight"][:, q]
        out[f"{p}.mlp.gate_up_proj.weight"] = torch.cat([w["mlp.gate_proj.weight"][m], w["mlp.up_proj.weight"][m]])
        out[f"{p}.mlp.down_proj.weight"] = w["mlp.down_proj.weight"][:, m]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = w[f"{norm}.weight"]
    return out


def load_rank(path: Path, rank: int, size: int, quantization: str = "none", dtype: torch.dtype = torch.float32) -> LoadedModel:
    tp = TensorParallel(Shard(rank, size))
    return load_model(path, dtype, "cpu", paged_attention_reference, quantization, pack=False, tp=tp)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("variant", list(CONFIGS))
def test_every_rank_holds_exactly_its_slices_of_a_sharded_checkpoint(tmp_path: Path, variant: str, size: int):
    config = CONFIGS[variant]
    weights = write_sharded_checkpoint(config, tmp_path)
    whole = dict(load_rank(tmp_path, 0, 1).model.named_parameters())
    for rank in range(size):
        loaded = load_rank(tmp_path, rank, size)
        assert loaded.config == config and loaded.model.config == Shard(rank, size).local_config(config)
        params = dict(loaded.model.named_parameters())
        expected = expected_slices(weights, config, rank, size)
        assert set(params) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor), f"rank {rank} of {size}: {name}"
    # the TP=1 model is the checkpoint itself
    for name, tensor in expected_slices(weights, config, 0, 1).items():
        assert torch.equal(whole[name], tensor), name


@pytest.mark.parametrize("size", [1, 2, 4])
def test_int8_quantizes_each_slice_as_it_loads(tmp_path: Path, size: int):
    config = CONFIGS["qwen2"]
    weights = write_sharded_checkpoint(config, tmp_path)
    for rank in range(size):
        int8 = load_rank(tmp_path, rank, size, "int8", torch.bfloat16).model
        expected = expected_slices({n: t.bfloat16() for n, t in weights.items()}, config, rank, size)
        modules = dict(int8.named_modules())
        assert sum(isinstance(m, Int8Linear) for m in modules.values()) == 4 * config.num_layers
        assert not any(isinstance(m, torch.nn.Linear) for m in modules.values()), "no projection was ever held in bf16"
        for name, tensor in expected.items():
            module_name, _, kind = name.rpartition(".")
            module = modules[module_name]
            if isinstance(module, Int8Linear) and kind == "weight":
                weight_int8, scale = quantize_int8(tensor)
                assert torch.equal(module.weight_int8, weight_int8) and torch.equal(module.scale, scale), name
            else:
                assert torch.equal(getattr(module, kind), tensor), name


def test_int8_as_it_loads_equals_quantizing_the_loaded_model(tmp_path: Path):
    write_sharded_checkpoint(CONFIGS["llama"], tmp_path)
    loaded = load_rank(tmp_path, 0, 1, "int8", torch.bfloat16).model
    reference = quantize_model(load_rank(tmp_path, 0, 1, "none", torch.bfloat16).model, "int8")
    buffers = dict(loaded.named_buffers())
    reference_buffers = dict(reference.named_buffers())
    assert any(name.endswith("weight_int8") for name in buffers) and buffers.keys() == reference_buffers.keys()
    for name, tensor in reference_buffers.items():
        assert torch.equal(buffers[name], tensor), name
    for name, param in reference.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], param), name


@dataclass
class CountingSource:
    """A TensorSource that counts the elements it was asked for."""

    source: TensorSource
    counts: list[int]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    def read(self, dim: int, start: int, end: int) -> torch.Tensor:
        values = self.source.read(dim, start, end)
        self.counts.append(values.numel())
        return values


@pytest.mark.parametrize("rank", [0, 3])
def test_a_rank_reads_only_its_share_of_the_checkpoint(tmp_path: Path, rank: int):
    config = tiny_config(vocab_size=510, num_kv_heads=4, tie_word_embeddings=False)  # no KV head replicated
    weights = write_sharded_checkpoint(config, tmp_path)
    shard = Shard(rank, 4)
    model = LlamaForCausalLM.empty(shard.local_config(config), paged_attention_reference, torch.float32, "cpu", TensorParallel(shard))
    counts: list[int] = []
    sources: Iterator[tuple[str, TensorSource]] = ((name, CountingSource(s, counts)) for name, s in read_safetensors(tmp_path))
    load_tensors(model, config, sources)
    padding = 2 * config.hidden_size * (rank == 3) * 2  # two padding rows in each of embed_tokens and lm_head
    norms = (2 * config.num_layers + 1) * config.hidden_size  # every rank holds them whole
    share = (sum(t.numel() for t in weights.values()) - norms) / 4 + norms
    assert sum(counts) == sum(p.numel() for p in model.parameters()) - padding
    assert sum(counts) <= share + config.hidden_size * 2, f"read {sum(counts)} elements, the rank's share is {share:.0f}"


def test_a_gguf_loads_each_rank_its_slices(tmp_path: Path):
    """Row slices of llama.cpp-permuted Q and K are dequantized and un-permuted head by head."""
    config = tiny_config(tie_word_embeddings=False, max_position_embeddings=64)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, config, hf_state_dict(random_model(config, seed=3, attention=paged_attention_reference)))
    whole = load_rank(path, 0, 1)
    weights = hf_state_dict(whole.model)
    for rank in range(2):
        params = dict(load_rank(path, rank, 2).model.named_parameters())
        for name, tensor in expected_slices(weights, config, rank, 2).items():
            assert torch.equal(params[name], tensor), f"rank {rank}: {name}"
