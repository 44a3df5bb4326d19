"""Hugging Face tensor names <-> a rank's parameters (which fuse q/k/v and gate/up).

`placements` says, for every checkpoint tensor, which slice of it a rank reads and where in its
parameters that slice goes (tensor_parallel.Shard says which heads, MLP rows and vocabulary rows a
rank holds). Every format's reader yields (Hugging Face name, TensorSource) pairs: a tensor not yet
read, of which `load_tensors` reads only the rank's slice, converts it to the model's dtype on its
device and, where the model's projection is an Int8Linear, quantizes it there (int8 scales are per
output row, so a slice quantizes alone). A checkpoint that leaves a tensor unset or holds one the
model has no place for is refused, so a wrong checkpoint fails at load, not as garbage text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.errors import StartupError
from tandem.models.config import ModelConfig
from tandem.models.llama import LlamaForCausalLM
from tandem.models.quant import Int8Linear, quantize_int8
from tandem.models.tensor_parallel import Shard

# Tensors some checkpoints carry that the model derives instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class TensorSource(Protocol):
    """A checkpoint tensor not yet read."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, dim: int, start: int, end: int) -> torch.Tensor:
        """Indices [start, end) of dimension `dim` (0 or 1), the rest whole."""
        ...


@dataclass(frozen=True)
class WholeTensor:
    """A tensor already in memory, as a TensorSource."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, dim: int, start: int, end: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, end - start)


@dataclass(frozen=True)
class Placement:
    """Where a rank's slice of one checkpoint tensor goes: indices [start, end) of the tensor's
    dimension `dim` fill the rows from `first_row` of the model's `module`'s `kind` ("weight" or
    "bias"; an Int8Linear's weight is its weight_int8 and scale rows)."""

    module: str
    kind: str
    first_row: int
    dim: int
    start: int
    end: int
    shape: tuple[int, ...]  # the checkpoint tensor's whole shape


def placements(config: ModelConfig, shard: Shard) -> dict[str, Placement]:
    """Hugging Face name -> its Placement on rank `shard` of a model of `config` (the whole model's)."""
    local = shard.local_config(config)
    hidden, head_dim = config.hidden_size, config.head_dim
    (q0, q1), (k0, k1), (m0, m1) = shard.q_heads(config), shard.kv_heads(config), shard.intermediate(config)
    v0, v1 = shard.vocab(config)
    out = {
        "model.embed_tokens.weight": Placement("model.embed_tokens", "weight", 0, 0, v0, v1, (config.vocab_size, hidden)),
        "model.norm.weight": Placement("model.norm", "weight", 0, 0, 0, hidden, (hidden,)),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Placement("lm_head", "weight", 0, 0, v0, v1, (config.vocab_size, hidden))
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{prefix}.{norm}.weight"] = Placement(f"{prefix}.{norm}", "weight", 0, 0, 0, hidden, (hidden,))
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            whole = (hidden,) if kind == "weight" else ()
            q, kv = (config.q_size, *whole), (config.kv_size, *whole)
            qkv = f"{attn}.qkv_proj"
            out[f"{attn}.q_proj.{kind}"] = Placement(qkv, kind, 0, 0, q0 * head_dim, q1 * head_dim, q)
            out[f"{attn}.k_proj.{kind}"] = Placement(qkv, kind, local.q_size, 0, k0 * head_dim, k1 * head_dim, kv)
            out[f"{attn}.v_proj.{kind}"] = Placement(qkv, kind, local.q_size + local.kv_size, 0, k0 * head_dim, k1 * head_dim, kv)
        out[f"{attn}.o_proj.weight"] = Placement(f"{attn}.o_proj", "weight", 0, 1, q0 * head_dim, q1 * head_dim, (hidden, config.q_size))
        gate_up = f"{mlp}.gate_up_proj"
        out[f"{mlp}.gate_proj.weight"] = Placement(gate_up, "weight", 0, 0, m0, m1, (config.intermediate_size, hidden))
        out[f"{mlp}.up_proj.weight"] = Placement(gate_up, "weight", local.intermediate_size, 0, m0, m1, (config.intermediate_size, hidden))
        out[f"{mlp}.down_proj.weight"] = Placement(f"{mlp}.down_proj", "weight", 0, 1, m0, m1, (hidden, config.intermediate_size))
    return out


@torch.no_grad()
def load_tensors(model: LlamaForCausalLM, config: ModelConfig, tensors: Iterable[tuple[str, TensorSource]]) -> None:
    """Reads this rank's slice of every checkpoint tensor into `model` (built for rank
    model.tp.shard of a model of `config`), one slice at a time. The last rank's padding rows of
    the vocabulary are zeroed."""
    table = placements(config, model.tp.shard)
    missing = set(table)
    unexpected: list[str] = []
    for name, source in tensors:
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue  # a tied checkpoint may still store its (identical) output matrix
        if name not in table:
            unexpected.append(name)
            continue
        place = table[name]
        if tuple(source.shape) != place.shape:
            raise StartupError(f"checkpoint tensor {name} has shape {tuple(source.shape)}, the model expects {place.shape}")
        _write(model.get_submodule(place.module), place, source.read(place.dim, place.start, place.end))
        missing.discard(name)
    if unexpected or missing:
        raise StartupError(
            f"checkpoint does not fit the model config: unexpected tensors {sorted(unexpected)[:5]}, missing tensors {sorted(missing)[:5]}"
        )
    v0, v1 = model.tp.shard.vocab(config)
    for matrix in (model.model.embed_tokens.weight, None if model.lm_head is None else model.lm_head.weight):
        if matrix is not None:
            matrix[v1 - v0 :].zero_()


def _write(module: torch.nn.Module, place: Placement, values: torch.Tensor) -> None:
    rows = slice(place.first_row, place.first_row + values.shape[0])
    if isinstance(module, Int8Linear) and place.kind == "weight":
        weight_int8, scale = quantize_int8(values.to(device=module.scale.device, dtype=module.scale.dtype))
        module.weight_int8[rows] = weight_int8
        module.scale[rows] = scale
        return
    target = getattr(module, place.kind)
    if target is None:  # the model has no bias there
        raise StartupError(f"the model's {place.module} has no {place.kind}")
    target[rows] = values


@torch.no_grad()
def load_hf_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies whole Hugging Face-named tensors into a one-rank model, converting to its dtype and device."""
    load_tensors(model, model.config, ((name, WholeTensor(tensor)) for name, tensor in weights))


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """A one-rank plain model's weights under Hugging Face names, fused parameters split (contiguous copies)."""
    out = {}
    for name, place in placements(model.config, model.tp.shard).items():
        param = getattr(model.get_submodule(place.module), place.kind)
        out[name] = param[place.first_row : place.first_row + place.end - place.start].detach().contiguous()
    return out
