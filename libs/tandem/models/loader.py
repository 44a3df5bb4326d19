"""One call from a checkpoint path to a ready model: config, weights and tokenizer, whatever the
format (a GGUF file or a Hugging Face safetensors folder)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from tandem.errors import StartupError
from tandem.kernels.gemm_choice import GemmChooser, GemmPolicy
from tandem.kernels.gemm_choice import cache_path as gemm_cache_path
from tandem.kernels.metadata import AttentionFn
from tandem.models.checkpoint_names import TensorSource, load_tensors
from tandem.models.compressed_tensors import checkpoint_quantization
from tandem.models.config import ModelConfig
from tandem.models.files import Quantization, open_model
from tandem.models.gguf_weights import read_gguf
from tandem.models.llama import LlamaForCausalLM
from tandem.models.packed import pack_model
from tandem.models.quant import quantized_empty
from tandem.models.safetensors_weights import read_hf_config, read_safetensors
from tandem.models.tensor_parallel import SINGLE, TensorParallel
from tandem.models.tokenizer import Tokenizer
from tandem.models.tokenizer import load_tokenizer as load_tokenizer  # its home is torch-free: the chat imports it there

# /proc/cpuinfo flags of CPUs with native bf16 matmul (x86 AVX512-BF16 or AMX, Arm BF16)
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig  # the whole model's (model.config is this rank's under tensor parallelism)
    tokenizer: Tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a reply: the model config's and the tokenizer's."""
        return tuple(dict.fromkeys([*self.config.eos_token_ids, *self.tokenizer.eos_token_ids]))


def load_model(
    path: Path | None,
    dtype: torch.dtype,
    device: torch.device | str,
    attention: AttentionFn,
    quantization: Quantization = "none",
    pack: bool = True,
    tp: TensorParallel = SINGLE,
    cpu_gemm: GemmPolicy = "auto",
) -> LoadedModel:
    """`path` None means the embedded SmolLM2 GGUF. The model of rank `tp.shard` is built empty on
    `device` and filled tensor by tensor with the slices that rank holds (checkpoint_names.py), so
    no process holds the whole model, nor a whole tensor a safetensors checkpoint slices.
    `quantization` "int8" ("fp8"): the attention and MLP projections are Int8Linear (Fp8Linear) from
    the start, each slice quantized as it is read (models/quant.py, models/fp8.py); the rest stays
    `dtype`. A checkpoint of FP8 weights (models/compressed_tensors.py) loads them as they are, as fp8.
    On a CPU the projections and logits are packed for the kernels where they serve the dtype
    (bf16 with AVX512-BF16, float32 with AVX2: models/packed.py); `pack` False keeps them as
    loaded (nn.Linear or Int8Linear, their weights readable by name); `cpu_gemm` is the policy that
    gives each packed projection its kernel per bucket of rows (kernels/gemm_choice.py)."""
    checkpoint = open_model(path)
    tensors: Iterable[tuple[str, TensorSource]]
    if checkpoint.format == "gguf":
        gguf = read_gguf(checkpoint.path)
        config, tokenizer = gguf.config(), Tokenizer.from_gguf(gguf.metadata)
        tensors = gguf.weights(config)
    else:
        config = read_hf_config(checkpoint.path)
        quantization = checkpoint_quantization(checkpoint.path, quantization)  # an FP8 checkpoint's weights stay FP8
        tokenizer = Tokenizer.from_hf_folder(checkpoint.path)
        tensors = read_safetensors(checkpoint.path, device)
    empty = LlamaForCausalLM.empty(tp.shard.local_config(config), attention, dtype, "meta", tp)
    model = quantized_empty(empty, quantization, device)
    load_tensors(model, config, tensors)
    if pack:
        model = pack_model(model, GemmChooser(cpu_gemm, path=gemm_cache_path()))
    return LoadedModel(model=model.eval(), config=config, tokenizer=tokenizer)


def default_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bfloat16 where the device computes it natively, else float32 (emulated bf16 on an older
    CPU is slower than float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if _cpu_flags() & CPU_BF16_FLAGS else torch.float32
    return torch.float32


def resolve_device(device: Literal["auto", "cpu", "cuda"], setting: str = "TANDEM_DEVICE") -> Literal["cpu", "cuda"]:
    """The device an engine runs on: "auto" is the GPU when torch sees one, else the CPU; "cuda"
    where torch sees no GPU is a StartupError naming `setting`, not a traceback from the first tensor."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise StartupError(f"{setting}=cuda, but torch {torch.__version__} ({build}) sees no CUDA GPU here: use cpu or auto")
    return device


def resolve_dtype(dtype: Literal["auto", "bf16", "fp32"], device: str) -> torch.dtype:
    """The engine's dtype on `device`: "auto" is bf16 where the device computes it natively, else fp32."""
    return default_dtype(device) if dtype == "auto" else {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]


def resolve_kv_cache_dtype(
    kv_cache_dtype: Literal["auto", "bf16", "fp32", "fp8"], dtype: torch.dtype, device: str, setting: str = "TANDEM_KV_CACHE_DTYPE"
) -> torch.dtype:
    """The KV cache's dtype under an engine of `dtype`: "auto" is the engine's; bf16 under a float32
    engine on the CPU halves what attention reads (the C++ kernels widen its rows exactly to
    float32); fp8 (float8_e4m3fn) under any engine, on the CPU or CUDA, a byte a value (every
    attention backend saturates what it stores to +-448 and widens what it reads). Any other pair
    no kernel serves is a StartupError naming `setting`."""
    names = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
    cache_dtype = dtype if kv_cache_dtype == "auto" else names[kv_cache_dtype]
    is_fp8 = cache_dtype == torch.float8_e4m3fn and device in ("cpu", "cuda")
    if cache_dtype != dtype and not is_fp8 and not (device == "cpu" and dtype == torch.float32 and cache_dtype == torch.bfloat16):
        raise StartupError(
            f"{setting}={kv_cache_dtype} under a {str(dtype).removeprefix('torch.')} engine on {device}: "
            "the cache holds the engine's dtype, fp8, or bf16 under fp32 on the CPU; use auto"
        )
    # triton converts to and from e4m3 (its float8e4nv) on compute capability 8.9 (Ada, Hopper) and later only
    if is_fp8 and device == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        raise StartupError(
            f"{setting}=fp8 on {torch.cuda.get_device_name()}: the GPU kernels' FP8 cache needs compute capability 8.9 or later"
        )
    return cache_dtype


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86 | Arm
            flags.update(value.split())
    return flags
