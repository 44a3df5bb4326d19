"""Reading a GGUF checkpoint: its metadata as plain Python values, and its tensors dequantized,
un-permuted and renamed to Hugging Face names.

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

    def weights(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) one at a time, so peak memory is one tensor's."""
        is_permuted = self.architecture in PERMUTED_ARCHITECTURES
        for gguf_name, tensor in self.tensors.items():
            if gguf_name == ROPE_FREQS_TENSOR:
                continue  # part of the config (rotary frequencies), not a parameter
            weight = _dequantized(tensor)
            name = hf_name(gguf_name)
            if is_permuted and ".self_attn.q_proj." in name:
                weight = unpermute_rotary(weight, config.num_heads)
            elif is_permuted and ".self_attn.k_proj." in name:
                weight = unpermute_rotary(weight, config.num_kv_heads)
            yield name, weight


def read_gguf(path: Path) -> GgufCheckpoint:
    reader = GGUFReader(path)
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    return GgufCheckpoint(reader=reader, metadata=metadata, tensors={t.name: t for t in reader.tensors})


def _dequantized(tensor: ReaderTensor) -> torch.Tensor:
    torch_shape = tuple(int(n) for n in reversed(tensor.shape))
    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
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
