"""Paged attention on the CPU through the C++ kernels (cpu_paged.cpp, loaded by cpu_extension):
the CPU backend when they build on this machine.

Same contract as attention_reference.paged_attention_reference. A step's new K and V go into the
cache in one call; decode rows (every row of a decode-only step, the one-row pieces of a mixed
step) read their context in place through the block table, one task per sequence and kv head,
float32 inside; prefill chunks take attention_torch's path (flash SDPA in whole absolute query
blocks). A decode row's arithmetic depends on its own context alone, so it has the same bits in
any company and in a decode-only or a mixed step. Unlike the torch path, nothing past a
sequence's end is read, so unowned slots may hold anything.

A q whose dtype differs from the cache's (the kernels take one dtype) goes the torch path.
"""

from __future__ import annotations

import torch

from tandem.kernels.attention_torch import mixed_attention, paged_attention_torch
from tandem.kernels.metadata import AttentionMetadata


def paged_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    if not q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype:
        return paged_attention_torch(q, k, v, k_cache, v_cache, meta, scale)
    torch.ops.tandem.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_decode_only:
        return decode_attention_cpu(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, meta.max_seq_len, scale)
    return mixed_attention(q, k_cache, v_cache, meta, scale, decode=decode_attention_cpu)


def decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """attention_torch.decode_attention's contract; max_seq_len is not needed (nothing is padded)."""
    return torch.ops.tandem.paged_decode(q, k_cache, v_cache, seq_lens, block_tables, scale)
