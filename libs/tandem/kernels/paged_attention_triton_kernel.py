"""The triton paged-attention kernel. Imports triton: load it through
tandem.kernels.paged_attention_triton, whose wrapper checks the inputs and launches it.

One program computes one (sequence, kv head, tile of query tokens): its rows are the tile's
query tokens times the `group` query heads that share the kv head (padded to a power of two),
so K and V are read once per kv head, not once per query head. The program walks the sequence's
context KV_TILE keys at a time, gathering each key's block through the block table (any block
size works: a key's block is key // BLOCK_SIZE), with an online softmax in float32.

A head size that is not a power of two (Phi-3's 96) is padded to HEAD_PAD lanes, masked in every
load and store. A sliding window (window > 0) starts the walk at the tile's first query's window
(the tiles wholly before it are skipped) and masks each row's keys before its own; a soft-cap
caps the scores (softcap * tanh(score / softcap), in the exp2 domain) before the mask. An FP8
cache's keys and values are widened to q's dtype as they are loaded (exact for e4m3).

Whether @triton.jit compiles or interprets is decided when this module is imported
(TRITON_INTERPRET=1 in the environment then: numpy on CPU tensors).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2_E = 1.4426950408889634


@triton.jit
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel exponentiates with exp2
    window,  # > 0: each query sees its last `window` positions; 0: its whole context
    softcap_log2,  # softcap * log2(e) when HAS_SOFTCAP
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    k_stride_b,
    k_stride_s,
    k_stride_h,
    v_stride_b,
    v_stride_s,
    v_stride_h,
    block_tables_stride_s,
    block_tables_stride_b,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * GROUP_PAD rows
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    KV_TILE: tl.constexpr,  # keys per loop iteration (a power of two)
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (at least 16, tl.dot's minimum)
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_start = seq_len - q_len  # absolute position of the sequence's first new token

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_index = q_tile * BLOCK_Q + rows // GROUP_PAD
    member = rows % GROUP_PAD
    is_row = (q_index < q_len) & (member < GROUP)
    head = kv_head * GROUP + member
    dims = tl.arange(0, HEAD_PAD)
    is_dim = dims < HEAD_DIM
    q_offsets = (q_start + q_index)[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=is_row[:, None] & is_dim[None, :], other=0.0)
    q_pos = context_start + q_index
    # The tile's first query sees keys from its window's start on; tiles of keys before it are skipped.
    first_key = tl.where(window > 0, tl.maximum(context_start + q_tile * BLOCK_Q - window + 1, 0), 0) // KV_TILE * KV_TILE

    # The tile's last query sees keys 0..its position; later keys are never needed.
    num_keys = context_start + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    row_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    for tile_start in range(first_key, num_keys, KV_TILE):
        key_pos = tile_start + tl.arange(0, KV_TILE)
        is_key = key_pos < num_keys
        block_id = tl.load(
            block_tables_ptr + seq * block_tables_stride_s + (key_pos // BLOCK_SIZE) * block_tables_stride_b,
            mask=is_key,
            other=0,
        ).to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        k_offsets = block_id[:, None] * k_stride_b + slot[:, None] * k_stride_s + kv_head * k_stride_h + dims[None, :]
        v_offsets = block_id[:, None] * v_stride_b + slot[:, None] * v_stride_s + kv_head * v_stride_h + dims[None, :]
        # Masked loads: slots past the context may hold anything (NaN included) and 0 * NaN is NaN.
        is_kv = is_key[:, None] & is_dim[None, :]
        keys = tl.load(k_cache_ptr + k_offsets, mask=is_kv, other=0.0).to(q_ptr.dtype.element_ty)
        values = tl.load(v_cache_ptr + v_offsets, mask=is_kv, other=0.0).to(q_ptr.dtype.element_ty)

        scores = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale_log2
        if HAS_SOFTCAP:  # softcap * tanh(score / softcap), tanh(x) = 1 - 2 / (e^2x + 1): +-1 at the extremes, never NaN
            scores = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap_log2) + 1.0))
        is_visible = (key_pos[None, :] <= q_pos[:, None]) & is_key[None, :]
        is_visible = is_visible & ((window == 0) | (key_pos[None, :] > q_pos[:, None] - window))
        scores = tl.where(is_visible, scores, float("-inf"))
        # A row may see no key of a tile yet (its window starts later): its max stays -inf, and
        # a shift of 0 keeps -inf - -inf (NaN) out of the correction and the probabilities.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(row_max - shift)
        probs = tl.exp2(scores - shift[:, None])
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
        row_max = new_max

    out = acc / row_sum[:, None]
    out_offsets = (q_start + q_index)[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_dim[None, :])


def is_interpreted() -> bool:
    """True when this module was imported with TRITON_INTERPRET=1: the kernel runs on CPU tensors."""
    return isinstance(paged_attention_kernel, InterpretedFunction)
