"""Paged attention in plain torch, batched: the CPU backend (correct on any device).

Same contract as attention_reference.paged_attention_reference. The difference is the work
shape: the single-token rows (decodes) of a step go through SDPA together, padded; only prefill
chunks (query length > 1, a few per step) are handled one sequence at a time.

Decode rows: each sequence's blocks are gathered through its block table into a padded
(num_seqs, max_ctx, num_kv_heads, head_dim) tensor and masked by length. GQA costs no copy: a
decode has one query token, so the `group` query heads that share a kv head become that kv
head's `group` query rows. On CPU the decodes go a few sequences (about 3 MiB of K and V) at a
time, which keeps the gathered blocks in cache until SDPA reads them.

Host reads: on a GPU a decode-only step (the steady state of a decode worker) reads nothing
back; on CPU the lengths are host memory already. A mixed step reads the query starts and
context lengths once, to split decodes from prefill chunks.

A sliding window (window > 0) is one more term of the mask: the blocks wholly before a row's
window are still gathered (this path is the fallback; the C++ and triton kernels skip them). A
soft-cap (softcap > 0) cannot go through SDPA, which has no hook between the scores and the
softmax: such a layer's calls compute the scores, cap and mask them in float32 instead (_attend).

Padding reads slots past a sequence's end (the rest of its last block, table entries past its
blocks) and masks them out of the softmax; masking cannot undo a NaN or inf there, so the cache
must hold finite values everywhere (allocate it zeroed; the model's own K and V are finite).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tandem.kernels.attention_reference import write_kv
from tandem.kernels.metadata import AttentionMetadata


class DecodeFn(Protocol):
    """decode_attention's signature."""

    def __call__(
        self,
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
    ) -> torch.Tensor: ...


class PrefillFn(Protocol):
    """prefill_chunk_attention's signature: (q of one chunk, the caches, its block table row, its
    context length, scale) -> out."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...


# Gathered K and V per decode chunk on CPU: about what stays in cache from gather to SDPA.
_CPU_DECODE_CHUNK_BYTES = 3 << 20


def paged_attention_torch(
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
    if meta.is_decode_only:
        return decode_attention(
            q, k_cache, v_cache, meta.seq_lens, meta.block_tables, meta.max_seq_len, scale, window=window, softcap=softcap
        )
    return mixed_attention(q, k_cache, v_cache, meta, scale, window=window, softcap=softcap)


def decode_attention(
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
    """One query token per sequence: q (num_seqs, num_heads, head_dim), its context already in the
    cache. max_seq_len is a host-side upper bound of seq_lens (it sets the padding)."""
    if q.device.type != "cpu":
        return _padded_decode(q, k_cache, v_cache, seq_lens, block_tables, max_seq_len, scale, window, softcap)
    # On CPU, a few sequences at a time: a chunk's gathered K and V stay in cache between the
    # gather and SDPA, and no allocation is big enough to be fresh pages every call (one padded
    # gather of a whole large batch is several times slower). The lengths are host memory here, so reading
    # them costs nothing.
    num_seqs = q.shape[0]
    bytes_per_seq = 2 * max_seq_len * k_cache.shape[2] * k_cache.shape[3] * q.element_size()
    seqs_per_chunk = max(1, _CPU_DECODE_CHUNK_BYTES // bytes_per_seq)
    if seqs_per_chunk >= num_seqs:
        return _padded_decode(q, k_cache, v_cache, seq_lens, block_tables, max_seq_len, scale, window, softcap)
    # Chunks of similar lengths: each pads only to its own longest context, so a batch of mixed
    # lengths gathers (and attends over) little more than its real tokens.
    lens = seq_lens.tolist()
    order = sorted(range(num_seqs), key=lens.__getitem__)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for start in range(0, num_seqs, seqs_per_chunk):
        chunk = order[start : start + seqs_per_chunk]
        rows = torch.tensor(chunk, device=q.device)
        out.index_copy_(
            0,
            rows,
            _padded_decode(
                q.index_select(0, rows),
                k_cache,
                v_cache,
                seq_lens.index_select(0, rows),
                block_tables.index_select(0, rows),
                lens[chunk[-1]],
                scale,
                window,
                softcap,
            ),
        )
    return out


def _padded_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-max_seq_len // block_size)
    max_ctx = num_blocks * block_size
    # index_select copies whole blocks; it is several times faster than advanced indexing here.
    block_ids = block_tables[:, :num_blocks].reshape(-1).long()
    keys = _gather(k_cache, block_ids, q.dtype).view(num_seqs, max_ctx, num_kv_heads, head_dim)
    values = _gather(v_cache, block_ids, q.dtype).view(num_seqs, max_ctx, num_kv_heads, head_dim)
    key_pos = torch.arange(max_ctx, device=q.device)
    lens = seq_lens.to(q.device, torch.long).unsqueeze(1)
    is_valid = key_pos < lens
    if window > 0:
        is_valid &= key_pos >= lens - window
    out = _attend(
        q.reshape(num_seqs, num_kv_heads, group, head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        is_valid[:, None, None, :],
        scale,
        softcap,
    )
    return out.reshape(num_seqs, num_heads, head_dim)


# Prefill queries go in calls of whole blocks of absolute positions, each block against the keys
# from 0 to its end: 64 positions a block below position 512, 256 from there (fewer, larger calls
# where the context is long; small ones where a prompt is short). A query's bits then depend on
# its position and context alone, not on where its chunk starts or ends (a prompt split by the
# step budget, a cached prefix) nor on its chunk's other rows. One SDPA call over the chunk
# rounds a row differently as the chunk's shape changes, so the same prompt came out in other
# bits when chunked another way, and a greedy answer could depend on its company.
SHORT_QUERY_BLOCK, LONG_QUERY_BLOCK, LONG_FROM = 64, 256, 512


def query_blocks(start: int, end: int) -> list[tuple[int, int]]:
    """The blocks [block_start, block_end) that cover positions [start, end)."""
    blocks = []
    position = start
    while position < end:
        size = SHORT_QUERY_BLOCK if position < LONG_FROM else LONG_QUERY_BLOCK
        block_start = position // size * size
        blocks.append((block_start, block_start + size))
        position = block_start + size
    return blocks


def prefill_chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One sequence's chunk: q (q_len, num_heads, head_dim) are the last q_len tokens of its
    seq_len-token context; token j attends to positions 0..seq_len - q_len + j (the last `window`
    of them when window > 0)."""
    q_len, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    start = seq_len - q_len
    blocks = query_blocks(start, seq_len)
    padded_len = blocks[-1][1]
    block_ids = block_table[: -(-seq_len // block_size)].long()
    keys = _padded_context(_gather(k_cache, block_ids, q.dtype), seq_len, padded_len, num_kv_heads, head_dim)
    values = _padded_context(_gather(v_cache, block_ids, q.dtype), seq_len, padded_len, num_kv_heads, head_dim)
    # 4-D inputs and kv heads expanded (a copy the size of this chunk's context): CPU SDPA runs
    # its flash kernel only so; 3-D inputs or enable_gqa fall back to the much slower math path.
    keys, values = _expand_kv_heads(keys, num_heads)[None], _expand_kv_heads(values, num_heads)[None]
    positions = torch.arange(padded_len, device=q.device)
    out = torch.empty_like(q)
    for block_start, block_end in blocks:
        # A block's rows outside the chunk (computed by an earlier chunk, or past its end) are
        # zeros, their output dropped.
        first, last = max(block_start, start), min(block_end, seq_len)
        queries = q.new_zeros(block_end - block_start, num_heads, head_dim)
        queries[first - block_start : last - block_start] = q[first - start : last - start]
        mask = positions[:block_end] <= positions[block_start:block_end, None]
        if window > 0:
            mask &= positions[:block_end] > positions[block_start:block_end, None] - window
        attended = _attend(
            queries.transpose(0, 1)[None], keys[:, :, :block_end], values[:, :, :block_end], mask[None, None], scale, softcap
        )
        out[first - start : last - start] = attended[0, :, first - block_start : last - block_start].transpose(0, 1)
    return out


def _padded_context(gathered: torch.Tensor, seq_len: int, length: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """(num_kv_heads, length, head_dim): the context's first seq_len tokens, then zeros (masked)."""
    context = gathered.view(-1, num_kv_heads, head_dim)[:seq_len]
    if length > seq_len:
        context = F.pad(context, (0, 0, 0, 0, 0, length - seq_len))
    return context.transpose(0, 1)


def mixed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode: DecodeFn = decode_attention,
    prefill: PrefillFn | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """A step with prefill chunks: its decode rows together through `decode`, each chunk through
    `prefill` (None: prefill_chunk_attention)."""
    prefill = prefill_chunk_attention if prefill is None else prefill
    # One host read: where each sequence's rows start and how long its context is.
    num_seqs = meta.num_seqs
    host = torch.cat([meta.query_start_loc.long(), meta.seq_lens.long()]).tolist()
    starts, seq_lens = host[: num_seqs + 1], host[num_seqs + 1 :]
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    decode_seqs = [s for s in range(num_seqs) if q_lens[s] == 1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if decode_seqs:
        index = torch.tensor(decode_seqs, device=q.device)
        rows = torch.tensor([starts[s] for s in decode_seqs], device=q.device)
        decoded = decode(
            q.index_select(0, rows),
            k_cache,
            v_cache,
            meta.seq_lens[index],
            meta.block_tables[index],
            max(seq_lens[s] for s in decode_seqs),
            scale,
            window=window,
            softcap=softcap,
        )
        out.index_copy_(0, rows, decoded)
    for s in (s for s in range(num_seqs) if q_lens[s] > 1):  # the few prefill chunks
        chunk = slice(starts[s], starts[s + 1])
        out[chunk] = prefill(q[chunk], k_cache, v_cache, meta.block_tables[s], seq_lens[s], scale, window=window, softcap=softcap)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """SDPA of q over keys and values where mask is True, or with softcap > 0 the same in float32
    with the scores capped (SDPA has no step between scores and softmax)."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    scores = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), values.float()).to(q.dtype)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The listed blocks of one layer's strided cache view, contiguous, in the compute dtype."""
    return cache.index_select(0, block_ids).to(dtype)


def _expand_kv_heads(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(num_kv_heads, L, D) -> (num_heads, L, D), query head h reading kv head h // group."""
    num_kv_heads, length, head_dim = kv.shape
    if num_kv_heads == num_heads:
        return kv
    group = num_heads // num_kv_heads
    return kv.unsqueeze(1).expand(num_kv_heads, group, length, head_dim).reshape(num_heads, length, head_dim)
