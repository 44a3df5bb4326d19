"""Paged attention on the CPU through the C++ kernels (kernels/cpu/, loaded by cpu_extension):
the CPU backend when they build on this machine.

Same contract as attention_reference.paged_attention_reference. A step's new K and V go into the
cache in one call; decode rows (every row of a decode-only step, the one-row pieces of a mixed
step) read their context in place through the block table, one task per sequence and kv head,
float32 inside; so do prefill chunks (paged_prefill: one task per kv head and tile of rows, each
row attending exactly to its causal context, no mask, no gather copy; bf16 over a bf16 cache on
AMX tiles where the CPU has them, at about 3.5 times the vector units' rate on a 2,000-token
prompt: bench/attention.py). A row's arithmetic
depends on its own position and context alone, so it has the same bits in any company, in a
decode-only or a mixed step, however its prompt is chunked. Unlike the torch path, nothing past
a sequence's end is read, so unowned slots may hold anything.

The cache holds q's dtype, or bf16 under float32 q (a `kv_cache_dtype` of bfloat16: half the
bytes for attention to read, float32 arithmetic), or FP8 e4m3 under float32 or bf16 q (a quarter
or half the bytes; each value widened exactly to float32 as it is read); any other pair goes the
torch path, and a chunk whose head size or dtype paged_prefill does not serve here (it needs
AVX-512 or AVX2 and a head size of 64, 128 or 256, or 96 with AVX-512) goes attention_torch's
prefill_chunk_attention.

A sliding window (window > 0) makes a decode row skip the blocks wholly before its window and a
prefill tile the blocks before its first row's window; a soft-cap is one pass over a row's
scores. Both are branches outside the inner loops: window = 0 and softcap = 0 run as before.
"""

from __future__ import annotations

import functools

import torch

from tandem.kernels.attention_torch import mixed_attention, paged_attention_torch, prefill_chunk_attention
from tandem.kernels.metadata import AttentionMetadata


def paged_attention_cpu(
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
    prefill_kernel: int = -1,
) -> torch.Tensor:
    """`prefill_kernel`: paged_prefill's (-1: AMX tiles where they serve, else the vector units;
    0: the vector units; 1: AMX tiles), for bench/attention.py's side by side."""
    if not (q.dtype == k.dtype == v.dtype and k_cache.dtype == v_cache.dtype and kernels_take(q.dtype, k_cache.dtype)):
        return paged_attention_torch(q, k, v, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    torch.ops.tandem.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_decode_only:
        return decode_attention_cpu(
            q, k_cache, v_cache, meta.seq_lens, meta.block_tables, meta.max_seq_len, scale, window=window, softcap=softcap
        )
    prefill = prefill_attention_cpu if prefill_kernel == -1 else functools.partial(prefill_attention_cpu, kernel=prefill_kernel)
    return mixed_attention(q, k_cache, v_cache, meta, scale, decode=decode_attention_cpu, prefill=prefill, window=window, softcap=softcap)


def kernels_take(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernels serve q of `dtype` over a cache of `cache_dtype`: the same dtype, a
    bf16 cache under float32, or an FP8 e4m3 cache under float32 or bf16 (rows widened exactly to
    float32 as they are read)."""
    if cache_dtype == torch.float8_e4m3fn:
        return dtype in (torch.float32, torch.bfloat16)
    return cache_dtype == dtype or (dtype == torch.float32 and cache_dtype == torch.bfloat16)


def decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """attention_torch.decode_attention's contract; max_seq_len is not needed (nothing is padded)."""
    return torch.ops.tandem.paged_decode(q, k_cache, v_cache, seq_lens, block_tables, scale, window, softcap)


def prefill_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    kernel: int = -1,
) -> torch.Tensor:
    """attention_torch.prefill_chunk_attention's contract, through paged_prefill where it serves
    (`kernel`: paged_prefill's; the default takes AMX tiles for bf16 where the CPU has them)."""
    if not _prefill_serves(q.shape[-1], q.dtype):
        return prefill_chunk_attention(q, k_cache, v_cache, block_table, seq_len, scale, window=window, softcap=softcap)
    return torch.ops.tandem.paged_prefill(q, k_cache, v_cache, block_table, seq_len, scale, window, softcap, kernel)


@functools.cache
def _prefill_serves(head_dim: int, dtype: torch.dtype) -> bool:
    """Asked once per head size and dtype, not for every chunk (a dispatcher call each)."""
    return bool(torch.ops.tandem.prefill_supported(head_dim, dtype))
