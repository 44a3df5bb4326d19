"""Triton kernels for a GPU step's small element-wise parts, each one launch where torch takes
several: RMSNorm (eight), the residual add with the next RMSNorm (nine), q and k's rotation (about twenty), SiLU-and-mul (two) and the KV cache
write (six). Imports triton: load them through tandem.kernels.fused_triton, whose wrappers check
the inputs and launch them.

Each computes what the torch code it replaces computes, rounding where that rounds: float32
arithmetic, the result cast to the tensor's dtype at the same points (models/layers.py,
models/rotary.py). Launched with enable_fp_fusion=False, so a*b - c*d is two roundings as in
torch, not one fused multiply-add; only the reductions' order and exp/rsqrt's last bits may differ.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_rms_normed(h, weight_ptr, out_row_ptr, cols, is_col, num_cols, eps):
    """A row h (float32) normalized, rounded to the output's dtype, times the weight as RMSNorm does."""
    mean_square = tl.sum(h * h, axis=0) / num_cols
    normed = (h * (1.0 / tl.sqrt(mean_square + eps))).to(out_row_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=is_col, other=0.0).to(tl.float32)
    tl.store(out_row_ptr + cols, (weight * normed.to(tl.float32)).to(out_row_ptr.dtype.element_ty), mask=is_col)


@triton.jit
def rms_norm_kernel(x_ptr, weight_ptr, out_ptr, x_stride, out_stride, num_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    is_col = cols < num_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=is_col, other=0.0).to(tl.float32)
    _store_rms_normed(x, weight_ptr, out_ptr + row * out_stride, cols, is_col, num_cols, eps)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, residual_stride, out_stride, num_cols, eps, BLOCK: tl.constexpr
):
    """residual += x (rounded to its dtype, as torch's add), then out = RMSNorm(residual)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    is_col = cols < num_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=is_col, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * residual_stride + cols, mask=is_col, other=0.0).to(tl.float32)
    summed = (residual + x).to(residual_ptr.dtype.element_ty)
    tl.store(residual_ptr + row * residual_stride + cols, summed, mask=is_col)
    _store_rms_normed(summed.to(tl.float32), weight_ptr, out_ptr + row * out_stride, cols, is_col, num_cols, eps)


@triton.jit
def rotary_qk_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    qkv_stride,
    cos_stride,
    sin_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_HEADS + NUM_KV_HEADS rounded up to a power of two
    HALF: tl.constexpr,  # head_dim // 2
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two (Phi-3's 48 to 64), the rest masked
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)  # q's heads, then k's
    dims = tl.arange(0, HALF_PAD)
    is_dim = dims < HALF
    is_head = heads < NUM_HEADS + NUM_KV_HEADS
    source = qkv_ptr + token * qkv_stride + heads[:, None] * (2 * HALF) + dims[None, :]
    first = tl.load(source, mask=is_head[:, None] & is_dim[None, :], other=0.0).to(tl.float32)
    second = tl.load(source + HALF, mask=is_head[:, None] & is_dim[None, :], other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * cos_stride + dims, mask=is_dim, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * sin_stride + dims, mask=is_dim, other=0.0)[None, :]
    rotated_first = (first * cos - second * sin).to(q_ptr.dtype.element_ty)
    rotated_second = (second * cos + first * sin).to(q_ptr.dtype.element_ty)

    is_q = heads < NUM_HEADS
    q_head = tl.where(is_q, heads, 0)
    q_out = q_ptr + token * (NUM_HEADS * 2 * HALF) + q_head[:, None] * (2 * HALF) + dims[None, :]
    tl.store(q_out, rotated_first, mask=is_q[:, None] & is_dim[None, :])
    tl.store(q_out + HALF, rotated_second, mask=is_q[:, None] & is_dim[None, :])
    is_k = (heads >= NUM_HEADS) & is_head
    k_head = tl.where(is_k, heads - NUM_HEADS, 0)
    k_out = k_ptr + token * (NUM_KV_HEADS * 2 * HALF) + k_head[:, None] * (2 * HALF) + dims[None, :]
    tl.store(k_out, rotated_first, mask=is_k[:, None] & is_dim[None, :])
    tl.store(k_out + HALF, rotated_second, mask=is_k[:, None] & is_dim[None, :])


@triton.jit
def silu_and_mul_kernel(gate_up_ptr, out_ptr, gate_up_stride, out_stride, num_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    is_col = cols < num_cols
    gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=is_col, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * gate_up_stride + num_cols + cols, mask=is_col, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, (silu.to(tl.float32) * up).to(out_ptr.dtype.element_ty), mask=is_col)


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_stride_t,
    v_stride_t,
    k_cache_stride_b,
    k_cache_stride_s,
    v_cache_stride_b,
    v_cache_stride_s,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim, a token's K (or V), contiguous in both
    ROW_PAD: tl.constexpr,
    SATURATE: tl.constexpr,  # an FP8 cache: values clamped to +-SATURATE (448 for e4m3) before the cast
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cols = tl.arange(0, ROW_PAD)
    is_col = cols < ROW
    k = tl.load(k_ptr + token * k_stride_t + cols, mask=is_col)
    v = tl.load(v_ptr + token * v_stride_t + cols, mask=is_col)
    if SATURATE > 0:
        k = tl.minimum(tl.maximum(k.to(tl.float32), -SATURATE), SATURATE)
        v = tl.minimum(tl.maximum(v.to(tl.float32), -SATURATE), SATURATE)
    k_dst = k_cache_ptr + block * k_cache_stride_b + offset * k_cache_stride_s + cols
    v_dst = v_cache_ptr + block * v_cache_stride_b + offset * v_cache_stride_s + cols
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=is_col)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=is_col)
