"""A GPU step's small parts in one triton launch each (fused_triton_kernel): RMSNorm (alone or
with the residual add before it), q and k's rotation, SiLU-and-mul and the KV cache write. A
decode step of a small model is hundreds of kernels far too short to fill the GPU, so their
number, not their bytes, sets its time.

The models call these on CUDA tensors when triton is installed (`serves`), and torch otherwise.
Importing this module does not import triton; the first call does. Like the attention kernel,
they run on CPU tensors in triton's interpreter (TRITON_INTERPRET=1 when first loaded), which is
how the tests check them on a machine without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch

from tandem.kernels.attention_reference import FP8_MAX

_MLP_COLUMNS = 1024  # SiLU-and-mul columns per program


@functools.cache
def is_triton_available() -> bool:
    """Whether triton is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def serves(x: torch.Tensor) -> bool:
    """Whether the models call these for `x`: a CUDA tensor, triton installed."""
    return x.is_cuda and is_triton_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm's forward: x (T, hidden) with a unit-stride last dimension, weight (hidden,)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} (strides {x.stride()}) and weight {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = next_power_of_2(x.shape[1])
        _kernels().rms_norm_kernel[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps, BLOCK=block, **_EXACT)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`residual += x` in place, then RMSNorm(residual), in one launch: a decoder layer's residual
    add and the next norm. x and residual (T, hidden) of one dtype, unit-stride rows."""
    if x.dim() != 2 or x.shape != residual.shape or x.dtype != residual.dtype or x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} for rows of {x.shape[1]}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _kernels().add_rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), x.shape[1], eps,
            BLOCK=next_power_of_2(x.shape[1]), **_EXACT,
        )  # fmt: skip
    return out


def rotary_qk(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, num_heads, head_dim) and k (T, num_kv_heads, head_dim) rotated (rotary.apply_rotary),
    from qkv (T, (num_heads + 2 * num_kv_heads) * head_dim) and cos, sin (T, 1, head_dim / 2) float32."""
    num_tokens = qkv.shape[0]
    half = cos.shape[-1]
    if qkv.dim() != 2 or qkv.stride(-1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * 2 * half:
        raise ValueError(
            f"rotary_qk: qkv {tuple(qkv.shape)} (strides {qkv.stride()}) for {num_heads} + 2 x {num_kv_heads} heads of {2 * half}"
        )
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (num_tokens, 1, half) or table.dtype != torch.float32 or table.stride(-1) != 1:
            raise ValueError(f"rotary_qk: {name} {tuple(table.shape)} {table.dtype}, not ({num_tokens}, 1, {half}) float32")
    q = torch.empty((num_tokens, num_heads, 2 * half), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((num_tokens, num_kv_heads, 2 * half), dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _kernels().rotary_qk_kernel[(num_tokens,)](
            qkv, cos, sin, q, k, qkv.stride(0), cos.stride(0), sin.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HEADS_PAD=next_power_of_2(num_heads + num_kv_heads), HALF=half, HALF_PAD=next_power_of_2(half), **_EXACT,
        )  # fmt: skip
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up (T, 2 * intermediate) = [gate | up] per row."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} (strides {gate_up.stride()})")
    num_cols = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], num_cols), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        block = min(_MLP_COLUMNS, next_power_of_2(num_cols))
        grid = (gate_up.shape[0], -(-num_cols // block))
        _kernels().silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), num_cols, BLOCK=block, **_EXACT)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """attention_reference.write_kv (an FP8 cache's values saturated to +-448): token t's K and V (num_kv_heads, head_dim) into slot
    slot_mapping[t] of the (num_blocks, block_size, num_kv_heads, head_dim) caches, whose blocks
    may be strided (a layer's view of the engine's cache); a token's heads must be contiguous."""
    num_tokens = k.shape[0]
    row = k.shape[1] * k.shape[2]
    for name, tensor in (("k", k), ("v", v)):
        if tensor.shape != k.shape or tensor.stride(-1) != 1 or tensor.stride(-2) != k.shape[2]:
            raise ValueError(f"write_kv: {name} {tuple(tensor.shape)} strides {tensor.stride()}: a token's heads must be contiguous")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.shape[2:] != k.shape[1:] or cache.stride(-1) != 1 or cache.stride(-2) != k.shape[2]:
            raise ValueError(f"write_kv: {name} {tuple(cache.shape)} strides {cache.stride()} for k {tuple(k.shape)}")
    if num_tokens:
        _kernels().write_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            BLOCK_SIZE=k_cache.shape[1], ROW=row, ROW_PAD=next_power_of_2(row),
            SATURATE=FP8_MAX if k_cache.dtype == torch.float8_e4m3fn else 0.0,
        )  # fmt: skip


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (triton's block shapes), without importing triton."""
    return 1 << (n - 1).bit_length()


_EXACT = {"enable_fp_fusion": False}  # a*b - c*d rounded twice, as torch computes it


@functools.cache
def _kernels() -> ModuleType:
    from tandem.kernels import fused_triton_kernel

    return fused_triton_kernel
