"""Reading a GGUF checkpoint: its metadata as plain Python values, and its tensors renamed to
Hugging Face names, each dequantized when the loader reads it (only the rows a rank holds, where it
slices rows) and un-permuted. Nothing is converted ahead: a tensor's float32 values live while the
loader copies them into the model's dtype.

Two llama.cpp conventions are undone here:
- GGUF lists a tensor's shape fastest dimension first (ggml's `ne`), the reverse of torch's; the
  reader's numpy data is already row-major, so the torch shape is the GGUF shape reversed.
- llama.cpp's convert_hf_to_gguf permutes the rows of Q and K (weights and biases, llama
  architecture only) so its rotary pairs adjacent dimensions (2i, 2i+1); Hugging Face pairs i with
  i + head_dim/2. `unpermute_rotary` restores the Hugging Face order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor
from gguf.quants import dequantize

from tandem.models.config import ModelConfig

ROPE_FREQS_TENSOR = "rope_freqs.weight"
# Architectures whose Q/K rows llama.cpp's converter permuted (its LlamaModel.modify_tensors).
PERMUTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; unknown names come back unchanged, so the loader
    reports them as unexpected instead of silently dropping them."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"
    return gguf_name


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's
    `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`:
    within each head, rows (2i, 2i+1) go back to (i, i + head_dim/2). Works for weights and biases."""
    rows, *rest = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class GgufCheckpoint:
    reader: GGUFReader
    metadata: dict[str, Any]
    tensors: dict[str, ReaderTensor]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def rope_freq_factors(self) -> tuple[float, ...] | None:
        """Llama 3 rotary scaling, kept as a tensor in GGUF; None when the model has none."""
        if ROPE_FREQS_TENSOR not in self.tensors:
            return None
        return tuple(_dequantized(self.tensors[ROPE_FREQS_TENSOR]).tolist())

    def config(self) -> ModelConfig:
        return ModelConfig.from_gguf(self.metadata, self.tensors.keys(), self.rope_freq_factors())

    def weights(self, config: ModelConfig) -> Iterator[tuple[str, GgufTensor]]:
        """(Hugging Face name, tensor not yet read), one at a time."""
        is_permuted = self.architecture in PERMUTED_ARCHITECTURES
        for gguf_name, tensor in self.tensors.items():
            if gguf_name == ROPE_FREQS_TENSOR:
                continue  # part of the config (rotary frequencies), not a parameter
            name = hf_name(gguf_name)
            is_rotary = is_permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)
            yield name, GgufTensor(tensor, config.head_dim if is_rotary else 0)


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF (checkpoint_names.TensorSource). `rotary_head_dim`: its rows are
    llama.cpp-permuted Q or K heads of that size (0: not permuted)."""

    tensor: ReaderTensor
    rotary_head_dim: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensor.shape))

    def read(self, dim: int, start: int, end: int) -> torch.Tensor:
        """A row slice dequantizes those rows alone (GGUF blocks never cross a row); a column
        slice dequantizes the whole tensor first. Q and K rows slice at whole heads."""
        if dim == 1:
            return _dequantized(self.tensor)[:, start:end]
        rows = self.tensor.data[start:end] if len(self.shape) > 1 else None
        values = _dequantized(self.tensor)[start:end] if rows is None else _dequantized(self.tensor, rows, end - start)
        if self.rotary_head_dim:
            values = unpermute_rotary(values, (end - start) // self.rotary_head_dim)
        return values


def read_gguf(path: Path) -> GgufCheckpoint:
    reader = GGUFReader(path)
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    return GgufCheckpoint(reader=reader, metadata=metadata, tensors={t.name: t for t in reader.tensors})


def _dequantized(tensor: ReaderTensor, rows: np.ndarray | None = None, num_rows: int = 0) -> torch.Tensor:
    """The tensor's float32 values; `rows`: those of its data rows only (`num_rows` of them)."""
    torch_shape = tuple(int(n) for n in reversed(tensor.shape))
    if rows is not None:
        torch_shape = (num_rows, *torch_shape[1:])
    values = np.asarray(dequantize(tensor.data if rows is None else rows, tensor.tensor_type), dtype=np.float32)
    if not values.flags.writeable:  # float32 tensors come back as views of the read-only file map
        values = values.copy()
    return torch.from_numpy(values.reshape(torch_shape))


def _field_value(field: ReaderField) -> Any:
    """A metadata value as Python data (str, int, float, bool, or a list of them); written out
    rather than `ReaderField.contents()`, which older gguf releases lack."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]][0]
    if kind == GGUFValueType.FLOAT32:
        # float32 1e-5 widened is 9.99999974e-06; its shortest float32 repr is what was written
        return float(str(value))
    return value.item()
