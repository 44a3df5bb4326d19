"""What capacity depends on in a model: layers, KV heads, head dim, parameter count, weight dtype.

Given as numbers, or read from a checkpoint through tandem.models (the same config readers the
workers load with); the parameter count comes from the tensors' shapes, never their data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from tandem.errors import StartupError
from tandem.models.files import ModelFile, open_model

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# config.json's torch_dtype -> our dtype names
HF_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}
# Tandem dequantizes GGUF weights on load (gguf_weights.py); bf16 is what a GPU worker serves them in.
GGUF_SERVED_DTYPE = "bf16"


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    dtype: str  # the checkpoint's weight dtype as served (DTYPE_BYTES' keys)
    context_window: int | None = None  # the longest context the model takes; None: not known

    def __post_init__(self) -> None:
        for flag, value in (("--layers", self.num_layers), ("--kv-heads", self.num_kv_heads), ("--head-dim", self.head_dim)):
            if value <= 0:
                raise StartupError(f"{flag} must be a positive whole number, not {value}")
        if self.num_params <= 0:
            raise StartupError(f"--params must be positive, not {self.num_params}")
        if self.dtype not in DTYPE_BYTES:
            raise StartupError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")


def read_model_shape(path: Path | None) -> ModelShape:
    """From a .gguf file or a safetensors folder; None: the embedded SmolLM2."""
    checkpoint = open_model(path)
    try:
        return _read(checkpoint)
    except (KeyError, ValueError) as exc:  # a config without a needed key, or with inconsistent sizes
        raise StartupError(f"{checkpoint.path}: cannot read the model's shape ({type(exc).__name__}: {exc})") from None


def _read(checkpoint: ModelFile) -> ModelShape:
    # imported here: the weight readers pull in torch, which every `tandem` command would pay for
    from tandem.models.compressed_tensors import read_quantization
    from tandem.models.gguf_weights import ROPE_FREQS_TENSOR, read_gguf
    from tandem.models.safetensors_weights import read_hf_config

    if checkpoint.format == "gguf":
        gguf = read_gguf(checkpoint.path)
        config = gguf.config()
        num_params = sum(int(t.n_elements) for name, t in gguf.tensors.items() if name != ROPE_FREQS_TENSOR)
        dtype = GGUF_SERVED_DTYPE
    else:
        config = read_hf_config(checkpoint.path)
        num_params = _safetensors_num_params(checkpoint.path)
        hf_config = json.loads((checkpoint.path / "config.json").read_text())
        torch_dtype = hf_config.get("torch_dtype", "bfloat16")
        if torch_dtype not in HF_DTYPES:
            raise StartupError(f"{checkpoint.path}/config.json: torch_dtype {torch_dtype!r} is not one of {', '.join(HF_DTYPES)}")
        # an FP8 checkpoint (compressed-tensors) names its unquantized tensors' dtype; its projections, most of it, are fp8
        dtype = "fp8" if read_quantization(hf_config) is not None else HF_DTYPES[torch_dtype]
    return ModelShape(
        name=checkpoint.name,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_params=num_params,
        dtype=dtype,
        context_window=config.max_position_embeddings,
    )


def _safetensors_num_params(folder: Path) -> int:
    from tandem.models.safetensors_weights import safetensors_files

    total = 0
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open has no __iter__)
                num = 1
                for size in shard.get_slice(name).get_shape():
                    num *= size
                total += num
    return total
