"""Paged attention with a triton kernel: the GPU backend.

Same contract as attention_reference.paged_attention_reference. The wrapper checks what the
kernel assumes (shapes, dtypes, devices, a unit-stride head dimension) and passes every other
stride to it, so the cache's strided per-layer views are read in place.

Importing this module does not import triton; the first call does (see
paged_attention_triton_kernel for the kernel and for how TRITON_INTERPRET=1 runs it on CPU).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from tandem.kernels import fused_triton
from tandem.kernels.fused_triton import is_triton_available
from tandem.kernels.metadata import AttentionMetadata

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = torch.float8_e4m3fn  # a cache dtype under any of _DTYPES: widened to q's dtype as it is read
_INDEX_DTYPES = (torch.int32, torch.int64)
_KV_TILE = 64  # keys per kernel loop iteration
_DECODE_ROWS = 16  # query rows per program in a decode-only step: tl.dot's minimum
_PREFILL_ROWS = 64  # query rows per program when a step has prefill chunks


def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    check_inputs(q, k, v, k_cache, v_cache, meta)
    if window < 0 or softcap < 0:
        raise _invalid(f"window {window} and softcap {softcap} must be >= 0 (0: none)")
    kernels = _kernel_module()
    if q.device.type != "cuda" and not kernels.is_interpreted():
        raise _invalid(
            f"tensors are on {q.device}; the kernel needs CUDA tensors"
            " (or TRITON_INTERPRET=1 in the environment when it was first loaded, to run it on CPU)"
        )
    fused_triton.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = fused_triton.next_power_of_2(group)
    # A program's rows are query tokens x the group's heads (padded to a power of two): in a
    # decode step one token's heads, padded up to tl.dot's 16 rows; with prefill chunks, as many
    # tokens as fit in 64 rows.
    # Past 128 lanes of head (Gemma 2's 256) half the rows and keys a program holds, so its tiles
    # take the same registers and shared memory as at 128.
    head_pad = max(16, fused_triton.next_power_of_2(head_dim))
    is_wide = head_pad > 128
    rows = _DECODE_ROWS if meta.max_query_len == 1 else _PREFILL_ROWS // (2 if is_wide else 1)
    block_q = max(1, rows // group_pad)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    grid = (meta.num_seqs, num_kv_heads, _cdiv(meta.max_query_len, block_q))
    kernels.paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale * kernels.LOG2_E,
        window,
        softcap * kernels.LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
        meta.block_tables.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        KV_TILE=_KV_TILE // (2 if is_wide else 1),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        HAS_SOFTCAP=softcap > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Raise ValueError naming the first argument the kernel cannot take."""
    if q.dim() != 3:
        raise _invalid(f"q must be (num_tokens, num_heads, head_dim), got shape {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    if k_cache.dim() != 4:
        raise _invalid(f"k_cache must be (num_blocks, block_size, num_kv_heads, head_dim), got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise _invalid(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise _invalid(f"cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    if not 0 < head_dim <= 512:
        raise _invalid(f"head_dim must be 1 to 512, got {head_dim}")
    if num_heads % num_kv_heads:
        raise _invalid(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, new in (("k", k), ("v", v)):
        if new.shape != (num_tokens, num_kv_heads, head_dim):
            raise _invalid(f"{name} must be {(num_tokens, num_kv_heads, head_dim)}, got {tuple(new.shape)}")
    if q.dtype not in _DTYPES:
        raise _invalid(f"q dtype {q.dtype} is not one of {_DTYPES}")
    for name, tensor in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.dtype != q.dtype and not (name.endswith("_cache") and tensor.dtype == _FP8):
            raise _invalid(f"{name} dtype {tensor.dtype} != q dtype {q.dtype} (nor {_FP8} for a cache)")
    if k_cache.dtype != v_cache.dtype:
        raise _invalid(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    # The kernel is handed every stride but the head dimension's, which must be 1 (vector loads).
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.stride(-1) != 1:
            raise _invalid(f"{name} must have a contiguous last (head_dim) dimension, got strides {tensor.stride()}")

    num_seqs = meta.num_seqs
    expected_shapes = {"slot_mapping": (num_tokens,), "query_start_loc": (num_seqs + 1,), "seq_lens": (num_seqs,)}
    for name, shape in expected_shapes.items():
        if getattr(meta, name).shape != shape:
            raise _invalid(f"meta.{name} must be {shape}, got {tuple(getattr(meta, name).shape)}")
        if name != "slot_mapping" and getattr(meta, name).stride(0) != 1:  # the kernel indexes these by position
            raise _invalid(f"meta.{name} must be contiguous")
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != num_seqs:
        raise _invalid(f"meta.block_tables must be ({num_seqs}, max_blocks_per_seq), got {tuple(meta.block_tables.shape)}")
    if meta.block_tables.shape[1] * block_size < meta.max_seq_len:
        raise _invalid(f"meta.block_tables has {meta.block_tables.shape[1]} columns, too few for max_seq_len {meta.max_seq_len}")
    for name in (*expected_shapes, "block_tables"):
        if getattr(meta, name).dtype not in _INDEX_DTYPES:
            raise _invalid(f"meta.{name} dtype {getattr(meta, name).dtype} is not int32 or int64")

    others = {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache}
    others |= {f"meta.{name}": getattr(meta, name) for name in (*expected_shapes, "block_tables")}
    for name, tensor in others.items():
        if tensor.device != q.device:
            raise _invalid(f"{name} is on {tensor.device}, q on {q.device}")


def _invalid(message: str) -> ValueError:
    return ValueError(f"paged_attention_triton: {message}")


@functools.cache
def _kernel_module() -> ModuleType:
    if not is_triton_available():
        raise RuntimeError("paged_attention_triton: triton is not installed (pip install 'tandem-serve[gpu]')")
    from tandem.kernels import paged_attention_triton_kernel

    return paged_attention_triton_kernel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
