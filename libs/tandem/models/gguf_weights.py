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

import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from tandem.errors import StartupError
from tandem.models.config import ModelConfig

if TYPE_CHECKING:  # torch only where tensors are made: the chat reads a GGUF's tokenizer without it
    import torch

ROPE_FREQS_TENSOR = "rope_freqs.weight"
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope divisors
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
# Where an architecture's block tensors differ from llama's (llama.cpp's MODEL_TENSORS per arch).
_ARCH_BLOCK_NAMES = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "gemma2": {  # Gemma 2's four norms: "ffn_norm" is the one before the MLP
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    # Phi-3's fused projections, as Hugging Face's Phi-3 fuses them (rows q, k, v; gate, up)
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of architecture `arch`; unknown names come back
    unchanged, so the loader reports them as unexpected instead of silently dropping them."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    names = _BLOCK_NAMES | _ARCH_BLOCK_NAMES.get(arch, {})
    if match and match.group(2) in names:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{names[kind]}.{suffix}"
    return gguf_name


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's
    `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`:
    within each head, rows (2i, 2i+1) go back to (i, i + head_dim/2). Works for weights and biases."""
    rows, *rest = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class GgufTensorInfo:
    """A tensor of the file: `data` a read-only view of its bytes, as values (float types) or as
    (rows, bytes per row) of quantized blocks, as gguf's dequantize takes them."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest dimension first
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GgufCheckpoint:
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensorInfo]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def rope_freq_factors(self) -> tuple[float, ...] | None:
        """Llama 3 rotary scaling, kept as a tensor in GGUF; None when the model has none."""
        return self._values(ROPE_FREQS_TENSOR)

    def longrope_factors(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Phi-3's (long, short) longrope divisors; None when the model has none."""
        long_factor, short_factor = (self._values(name) for name in LONGROPE_TENSORS)
        if long_factor is None or short_factor is None:
            return None
        return long_factor, short_factor

    def _values(self, name: str) -> tuple[float, ...] | None:
        if name not in self.tensors:
            return None
        return tuple(GgufTensor(self.tensors[name]).read(0, 0, self.tensors[name].n_elements).tolist())

    def config(self) -> ModelConfig:
        return ModelConfig.from_gguf(self.metadata, self.tensors.keys(), self.rope_freq_factors(), self.longrope_factors())

    def weights(self, config: ModelConfig) -> Iterator[tuple[str, GgufTensor]]:
        """(Hugging Face name, tensor not yet read), one at a time."""
        is_permuted = self.architecture in PERMUTED_ARCHITECTURES
        for gguf_name, tensor in self.tensors.items():
            if gguf_name == ROPE_FREQS_TENSOR or gguf_name in LONGROPE_TENSORS:
                continue  # part of the config (rotary frequencies), not a parameter
            name = hf_name(gguf_name, self.architecture)
            is_rotary = is_permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name)
            yield name, GgufTensor(tensor, config.head_dim if is_rotary else 0)


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF (checkpoint_names.TensorSource). `rotary_head_dim`: its rows are
    llama.cpp-permuted Q or K heads of that size (0: not permuted)."""

    tensor: GgufTensorInfo
    rotary_head_dim: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensor.shape))

    def read(self, dim: int, start: int, end: int) -> torch.Tensor:
        """Only the slice's rows, or its columns where they are whole blocks (a GGUF's blocks run
        along a row), are dequantized; a slice inside blocks dequantizes the whole tensor first.
        Q and K rows slice at whole heads."""
        kind, data, shape = self.tensor.tensor_type, self.tensor.data, self.shape
        if len(shape) == 1:
            return _dequantized(kind, data, shape)[start:end]
        if dim == 0:
            values = _dequantized(kind, data[start:end], (end - start, *shape[1:]))
            return unpermute_rotary(values, (end - start) // self.rotary_head_dim) if self.rotary_head_dim else values
        if kind in _FLOAT_TYPES:
            return _dequantized(kind, data[:, start:end], (shape[0], end - start))
        block_size, type_size = GGML_QUANT_SIZES[kind]
        if start % block_size or end % block_size:
            return _dequantized(kind, data, shape)[:, start:end]
        blocks = data[:, start // block_size * type_size : end // block_size * type_size]
        return _dequantized(kind, blocks, (shape[0], end - start))


def read_gguf(path: Path) -> GgufCheckpoint:
    """The file's metadata and its tensors' places, read from its header (the tensors stay mapped,
    unread). Written out rather than gguf's GGUFReader, which makes a numpy view of every part of
    every value (seconds for a vocabulary's 100,000 strings: at every worker's start)."""
    data = np.memmap(path, mode="r")
    header = _Header(memoryview(data.data))
    if header.take("<4s")[0] != b"GGUF":
        raise StartupError(f"{path}: not a GGUF file")
    version, num_tensors, num_values = header.take("<IQQ")
    if not 2 <= version <= 3:
        raise StartupError(f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as another version)")
    metadata = {header.string(): header.value(GGUFValueType(header.take("<I")[0])) for _ in range(num_values)}
    infos = []
    for _ in range(num_tensors):
        name = header.string()
        (num_dims,) = header.take("<I")
        shape = header.take(f"<{num_dims}Q")
        tensor_type, offset = header.take("<IQ")
        infos.append((name, GGMLQuantizationType(tensor_type), tuple(int(n) for n in shape), offset))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-header.pos // alignment) * alignment
    tensors = {}
    for name, tensor_type, shape, offset in infos:
        rows_shape = tuple(reversed(shape))
        values = _FLOAT_TYPES.get(tensor_type)
        dtype: np.dtype[Any]
        if values is None:  # quantized blocks: bytes, a row of blocks per row
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            count, dtype = math.prod(shape) * type_size // block_size, np.dtype(np.uint8)
            rows_shape = quant_shape_to_byte_shape(rows_shape, tensor_type)
        else:
            count, dtype = math.prod(shape), values
        view = np.frombuffer(data, dtype=dtype, count=count, offset=start + offset).reshape(rows_shape)
        tensors[name] = GgufTensorInfo(name, tensor_type, shape, view)
    return GgufCheckpoint(metadata=metadata, tensors=tensors)


_FLOAT_TYPES: dict[GGMLQuantizationType, np.dtype[Any]] = {
    GGMLQuantizationType.F32: np.dtype(np.float32),
    GGMLQuantizationType.F16: np.dtype(np.float16),
}
_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}  # fmt: skip


class _Header:
    """Reads a GGUF header's values in order, as plain Python values."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.pos = 0

    def take(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buffer, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return bytes(self.buffer[start : self.pos]).decode("utf-8")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item_kind, count = self.take("<IQ")
            item_kind = GGUFValueType(item_kind)
            if item_kind in (GGUFValueType.STRING, GGUFValueType.ARRAY):
                return [self.value(item_kind) for _ in range(count)]
            dtype = np.dtype("<" + _SCALARS[item_kind])
            items = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return items.tolist()
        (value,) = self.take("<" + _SCALARS[kind])
        # float32 1e-5 widened is 9.99999974e-06; its shortest float32 repr is what was written
        return float(str(np.float32(value))) if kind == GGUFValueType.FLOAT32 else value


def _dequantized(kind: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values of `shape` from `data`: values or quantized blocks of type `kind`."""
    import torch

    values = np.asarray(dequantize(data, kind), dtype=np.float32)
    if not values.flags.writeable or not values.flags.c_contiguous:  # float32 data comes back as a view of the file map
        values = np.array(values, order="C")
    return torch.from_numpy(values.reshape(shape))
