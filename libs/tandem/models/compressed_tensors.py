"""Pre-quantized safetensors checkpoints: which ones Tandem loads, read from config.json's
`quantization_config`.

Loaded: FP8 weights as llm-compressor writes them (quant_method "compressed-tensors", format
"float-quantized" or "naive-quantized", every config group's weights 8-bit floats with a scale per
output channel or per tensor), and as AutoFP8 wrote them before (quant_method "fp8" without
blocks). Their tensors: each projection's `weight` in float8_e4m3fn and its `weight_scale`, (out, 1)
or one number; with static activation scales an `input_scale` (not used: a GPU quantizes each row
of activations with its own scale, a CPU multiplies in the activations' dtype); with a
kv_cache_scheme, each attention layer's `k_scale` and `v_scale`. They load as they are into
models/fp8.py's Fp8Linear, slice by slice (checkpoint_names.Fp8Scales), never dequantized; the
modules a checkpoint leaves unquantized (`ignore`) load as they are, their projections quantized to
fp8 as they load. Any other quantization (AWQ, GPTQ, bitsandbytes, int4 or int8 compressed-tensors,
block-wise FP8) is refused at start, by name.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import StartupError
from tandem.models.files import Quantization

log = logging.getLogger(__name__)

SUPPORTED = (
    'FP8 weights: quant_method "compressed-tensors" (format float-quantized or naive-quantized, weights 8-bit float, '
    'strategy channel or tensor) or "fp8" without weight_block_size'
)
FLOAT_FORMATS = ("float-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("channel", "tensor")


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's config.json says of its weights."""

    method: str  # quant_method
    weight_strategy: str  # "channel" | "tensor"
    activations: str  # "dynamic" | "static" | "none": how its input_scale tensors were meant
    kv_cache_scales: bool  # its attention layers carry k_scale and v_scale


def read_quantization(hf_config: dict[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's FP8 scheme, None for a checkpoint of plain weights; a StartupError for a
    quantization Tandem does not load."""
    config = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise StartupError(f"config.json's quantization_config is {type(config).__name__}, not an object")
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fp8":
        return _auto_fp8(config)
    raise _unsupported(f"quant_method {method!r}{_bits(config)}")


def checkpoint_quantization(folder: Path, asked: Quantization) -> Quantization:
    """How a safetensors folder's projections are kept: `asked`, unless its weights are FP8
    already: then "fp8" ("none" would dequantize them all; their rows and scales are kept as they
    are), and "int8" is refused (it would requantize rounded weights)."""
    scheme = read_quantization(json.loads((folder / "config.json").read_text()))
    if scheme is None:
        return asked
    if asked == "int8":
        raise StartupError(
            f"{folder} holds FP8 weights ({scheme.method}, per {scheme.weight_strategy}); TANDEM_QUANTIZATION=int8 would requantize "
            "them: use none or fp8, which keep them as they are"
        )
    log.info(
        "%s: FP8 weights (%s, scale per %s, %s activation scales%s) kept as they are",
        folder, scheme.method, scheme.weight_strategy, scheme.activations, ", KV cache scales" if scheme.kv_cache_scales else "",
    )  # fmt: skip
    return "fp8"


def _compressed_tensors(config: dict[str, Any]) -> CheckpointQuantization:
    form = config.get("format")
    if form not in FLOAT_FORMATS:
        raise _unsupported(f"compressed-tensors format {form!r}")
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _unsupported("compressed-tensors without config_groups")
    strategies, activations = set(), set()
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        num_bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
        if num_bits != 8 or kind != "float" or strategy not in WEIGHT_STRATEGIES or weights.get("dynamic"):
            what = f"{num_bits}-bit {kind} weights per {strategy}" + (" (dynamic)" if weights.get("dynamic") else "")
            raise _unsupported(f"compressed-tensors config group {name!r} with {what}")
        strategies.add(strategy)
        inputs = group.get("input_activations")
        activations.add("none" if not inputs else "dynamic" if inputs.get("dynamic") else "static")
    kv_scheme = config.get("kv_cache_scheme")
    if kv_scheme and (kv_scheme.get("num_bits") != 8 or kv_scheme.get("type") != "float"):
        raise _unsupported(f"a kv_cache_scheme of {kv_scheme.get('num_bits')}-bit {kv_scheme.get('type')}")
    return CheckpointQuantization(
        "compressed-tensors",
        "channel" if "channel" in strategies else "tensor",
        "/".join(sorted(activations)),
        bool(kv_scheme),
    )


def _auto_fp8(config: dict[str, Any]) -> CheckpointQuantization:
    if config.get("weight_block_size"):
        raise _unsupported(f"block-wise fp8 (weight_block_size {config['weight_block_size']}, weight_scale_inv)")
    return CheckpointQuantization("fp8", "tensor", str(config.get("activation_scheme", "dynamic")), bool(config.get("kv_cache_scheme")))


def _bits(config: dict[str, Any]) -> str:
    bits = config.get("bits", config.get("w_bit"))
    return "" if bits is None else f", {bits}-bit"


def _unsupported(what: str) -> StartupError:
    return StartupError(
        f"the checkpoint is quantized with {what}, which Tandem does not load; it loads {SUPPORTED}, or unquantized weights"
    )
