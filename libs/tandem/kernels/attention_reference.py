"""The obviously-correct paged attention: one sequence at a time, float32, explicit mask.

Every faster path is tested against this. Signature shared by all attention backends:

    attention(q, k, v, k_cache, v_cache, meta, scale) -> out

q (num_tokens, num_heads, head_dim); k, v (num_tokens, num_kv_heads, head_dim): this step's new
tokens, ragged as `meta` says. k_cache, v_cache (num_blocks, block_size, num_kv_heads, head_dim):
one layer's strided views of the engine's KV cache. The new k, v are written into the cache at
meta.slot_mapping first; then every new token attends causally to its sequence's whole context.
Returns (num_tokens, num_heads, head_dim) in q's dtype.
"""

from __future__ import annotations

import torch

from tandem.kernels.metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    block_size = k_cache.shape[1]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for s, seq_len in enumerate(meta.seq_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        q_len = end - start
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_tables[s, :num_blocks].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        key_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(q.dtype)
    return out
