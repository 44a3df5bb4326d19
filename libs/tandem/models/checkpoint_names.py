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

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tandem.errors import StartupError
from tandem.models.config import ModelConfig
from tandem.models.fp8 import FP8_DTYPE, Fp8Linear, quantize_fp8
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
        norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
        if config.sandwich_norms:  # Gemma 2
            norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        for norm in norms:
            out[f"{prefix}.{norm}.weight"] = Placement(f"{prefix}.{norm}", "weight", 0, 0, 0, hidden, (hidden,))
        if config.qk_norm:  # Qwen3: one weight for every head, whole on every rank
            for norm in ("q_norm", "k_norm"):
                out[f"{attn}.{norm}.weight"] = Placement(f"{attn}.{norm}", "weight", 0, 0, 0, head_dim, (head_dim,))
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


@dataclass(frozen=True)
class RowsOf:
    """Rows [first, first + count) of a checkpoint tensor, as a TensorSource of their own (one of
    the tensors a fused checkpoint tensor holds)."""

    source: TensorSource
    first: int
    count: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.count, *self.source.shape[1:])

    def read(self, dim: int, start: int, end: int) -> torch.Tensor:
        if dim == 0:
            return self.source.read(0, self.first + start, self.first + end)
        return self.source.read(dim, start, end).narrow(0, self.first, self.count)


@dataclass(frozen=True)
class PlusOffset:
    """A norm weight stored as w of (offset + w) (Gemma's), read as the (offset + w) the model scales by."""

    source: TensorSource
    offset: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    def read(self, dim: int, start: int, end: int) -> torch.Tensor:
        return self.source.read(dim, start, end).float() + self.offset


def as_llama_tensors(config: ModelConfig, tensors: Iterable[tuple[str, TensorSource]]) -> Iterator[tuple[str, TensorSource]]:
    """A checkpoint's tensors under the names `placements` knows, nothing read: Phi-3's fused
    `qkv_proj` and `gate_up_proj` as Llama's q/k/v and gate/up tensors (each rank reads its own
    rows of each), and Gemma's norm weights with their offset added (config.norm_weight_offset)."""
    fused = {
        "self_attn.qkv_proj": (("q_proj", config.q_size), ("k_proj", config.kv_size), ("v_proj", config.kv_size)),
        "mlp.gate_up_proj": (("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)),
    }
    for name, source in tensors:
        module, _, kind = name.rpartition(".")
        block, _, fused_name = module.rpartition(".")
        parent = block.rpartition(".")[2]
        parts = fused.get(f"{parent}.{fused_name}")
        if parts is not None and sum(rows for _, rows in parts) == source.shape[0]:
            first = 0
            for part, rows in parts:
                yield f"{block}.{part}.{kind}", RowsOf(source, first, rows)
                first += rows
        elif config.norm_weight_offset and module.endswith("norm") and kind == "weight":
            yield name, PlusOffset(source, config.norm_weight_offset)
        else:
            yield name, source


@torch.no_grad()
def load_tensors(model: LlamaForCausalLM, config: ModelConfig, tensors: Iterable[tuple[str, TensorSource]]) -> None:
    """Reads this rank's slice of every checkpoint tensor into `model` (built for rank
    model.tp.shard of a model of `config`), one slice at a time. The last rank's padding rows of
    the vocabulary are zeroed."""
    table = placements(config, model.tp.shard)
    missing = set(table)
    unexpected: list[str] = []
    fp8 = Fp8Scales()
    for name, source in as_llama_tensors(config, tensors):
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue  # a tied checkpoint may still store its (identical) output matrix
        if fp8.take(model, table, name, source):
            continue
        if name not in table:
            unexpected.append(name)
            continue
        place = table[name]
        if tuple(source.shape) != place.shape:
            raise StartupError(f"checkpoint tensor {name} has shape {tuple(source.shape)}, the model expects {place.shape}")
        values = source.read(place.dim, place.start, place.end)
        _write(model.get_submodule(place.module), place, values)
        if values.dtype == FP8_DTYPE:
            fp8.weights.add(name)
        missing.discard(name)
    if unexpected or missing:
        raise StartupError(
            f"checkpoint does not fit the model config: unexpected tensors {sorted(unexpected)[:5]}, missing tensors {sorted(missing)[:5]}"
        )
    fp8.check()
    v0, v1 = model.tp.shard.vocab(config)
    for matrix in (model.model.embed_tokens.weight, None if model.lm_head is None else model.lm_head.weight):
        if matrix is not None:
            matrix[v1 - v0 :].zero_()


def _write(module: torch.nn.Module, place: Placement, values: torch.Tensor) -> None:
    rows = slice(place.first_row, place.first_row + values.shape[0])
    if isinstance(module, Fp8Linear) and place.kind == "weight":
        if values.dtype == FP8_DTYPE:  # a pre-quantized checkpoint's rows, as they are; their scales come as weight_scale
            module.weight_fp8[rows] = values.to(module.weight_fp8.device)
        else:  # a slice quantizes alone, as int8's does: scales are per row (of the slice's columns)
            weight_fp8, scale = quantize_fp8(values.to(module.scale.device))
            module.weight_fp8[rows] = weight_fp8
            module.scale[rows] = scale
        return
    if values.dtype == FP8_DTYPE:
        raise StartupError(f"checkpoint tensor for {place.module}.{place.kind} is float8_e4m3fn, where the model keeps no fp8")
    if isinstance(module, Int8Linear) and place.kind == "weight":
        weight_int8, scale = quantize_int8(values.to(device=module.scale.device, dtype=module.scale.dtype))
        module.weight_int8[rows] = weight_int8
        module.scale[rows] = scale
        return
    target = getattr(module, place.kind)
    if target is None:  # the model has no bias there
        raise StartupError(f"the model's {place.module} has no {place.kind}")
    target[rows] = values


# A pre-quantized checkpoint's scales (models/compressed_tensors.py), read beside the tensors
# `placements` names: a projection's weight_scale, its static input_scale (not used: a GPU
# quantizes each row of activations with its own scale, a CPU does not quantize them), and an
# attention layer's fp8 KV cache scales under either name they are published with.
WEIGHT_SCALE, INPUT_SCALE = ".weight_scale", ".input_scale"
KV_SCALES = {".self_attn.k_scale": "k_scale", ".self_attn.v_scale": "v_scale"}
KV_SCALES_OLD = {".self_attn.k_proj.output_scale": "k_scale", ".self_attn.v_proj.output_scale": "v_scale"}


@dataclass
class Fp8Scales:
    """The scales of a checkpoint's fp8 tensors as they come, and which fp8 weights have one."""

    weights: set[str] = field(default_factory=set)  # the weights read as fp8
    scaled: set[str] = field(default_factory=set)  # the weights whose weight_scale was read

    def take(self, model: LlamaForCausalLM, table: dict[str, Placement], name: str, source: TensorSource) -> bool:
        """Whether `name` is a scale, written to the model (or, an input scale, passed over)."""
        if name.endswith(WEIGHT_SCALE):
            weight = name.removesuffix("_scale")
            place = table.get(weight)
            module = None if place is None else model.get_submodule(place.module)
            if place is None or not isinstance(module, Fp8Linear):
                raise StartupError(f"checkpoint tensor {name} scales no fp8 projection of the model")
            _write_weight_scale(module, place, name, source)
            self.scaled.add(weight)
            return True
        if name.endswith(INPUT_SCALE):  # also a fused projection's (Phi-3's qkv_proj), which nothing splits
            return math.prod(source.shape) == 1
        for suffixes in (KV_SCALES, KV_SCALES_OLD):
            for suffix, attribute in suffixes.items():
                if name.endswith(suffix):
                    _write_kv_scale(model, name.removesuffix(suffix) + ".self_attn", attribute, name, source)
                    return True
        return False

    def check(self) -> None:
        if unscaled := self.weights - self.scaled:
            raise StartupError(f"checkpoint has float8_e4m3fn weights without a weight_scale: {sorted(unscaled)[:5]}")
        if not_fp8 := self.scaled - self.weights:
            raise StartupError(f"checkpoint has a weight_scale for weights that are not float8_e4m3fn: {sorted(not_fp8)[:5]}")


def _read_whole(source: TensorSource) -> torch.Tensor:
    if isinstance(source, WholeTensor):
        return source.tensor
    return source.read(0, 0, source.shape[0] if source.shape else 1)


def _write_weight_scale(module: Fp8Linear, place: Placement, name: str, source: TensorSource) -> None:
    """A per-tensor scale given to every row of the tensor the rank holds; a per-channel one read
    for those rows (all of them under a column slice: o_proj's and down_proj's rows stay whole)."""
    out_features = place.shape[0]
    rows = place.end - place.start if place.dim == 0 else out_features
    target = module.scale[place.first_row : place.first_row + rows]
    shape = tuple(source.shape)
    if math.prod(shape) == 1:
        target.fill_(_read_whole(source).float().reshape(()).item())
    elif shape in ((out_features,), (out_features, 1)):
        values = source.read(0, place.start, place.end) if place.dim == 0 else source.read(0, 0, out_features)
        target.copy_(values.reshape(-1).float())
    else:
        raise StartupError(
            f"checkpoint tensor {name} has shape {shape}: a weight_scale is one per tensor or one per output channel ({out_features}, 1)"
        )


def _write_kv_scale(model: LlamaForCausalLM, attention: str, attribute: str, name: str, source: TensorSource) -> None:
    if math.prod(source.shape) != 1:
        raise StartupError(f"checkpoint tensor {name} has shape {tuple(source.shape)}: a KV cache scale is one number")
    try:
        module = model.get_submodule(attention)
    except AttributeError:
        raise StartupError(f"checkpoint tensor {name} belongs to no attention layer of the model") from None
    if hasattr(module, attribute):  # models/llama.py's LlamaAttention.k_scale, v_scale
        setattr(module, attribute, float(_read_whole(source).float().reshape(()).item()))


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
