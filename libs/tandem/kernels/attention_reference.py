"""The obviously-correct paged attention: one sequence at a time, float32, explicit mask.

Every faster path is tested against this. Signature shared by all attention backends:

    attention(q, k, v, k_cache, v_cache, meta, scale, *, window=0, softcap=0.0) -> out

q (num_tokens, num_heads, head_dim); k, v (num_tokens, num_kv_heads, head_dim): this step's new
tokens, ragged as `meta` says. k_cache, v_cache (num_blocks, block_size, num_kv_heads, head_dim):
one layer's strided views of the engine's KV cache. The new k, v are written into the cache at
meta.slot_mapping first; then every new token attends causally to its sequence's whole context,
or with window > 0 to its last `window` positions (itself included: Hugging Face's
`kv_idx > q_idx - sliding_window`). softcap > 0 caps every score (q . k * scale) as
softcap * tanh(score / softcap) before the mask and softmax. Returns (num_tokens, num_heads,
head_dim) in q's dtype.

An FP8 cache (torch.float8_e4m3fn) stores k and v as given, saturated to +-448 (e4m3's largest
finite value; a plain cast would make them NaN), and is widened to float32 as it is read. No scale
is applied here: a model with per-layer KV scales divides k and v by them before the call.
"""

from __future__ import annotations

import torch

from tandem.kernels.metadata import AttentionMetadata

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: a plain cast, or for an FP8 cache saturated to +-448 first."""
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    block_size = k_cache.shape[1]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[blocks, offsets] = to_cache_dtype(k, k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype(v, v_cache.dtype)


def paged_attention_reference(
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
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        is_hidden = key_pos > query_pos
        if window > 0:
            is_hidden |= key_pos <= query_pos - window
        scores = scores.masked_fill(is_hidden, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(q.dtype)
    return out
