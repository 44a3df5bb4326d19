"""Random paged-attention steps for the kernel tests: a whole engine KV cache (every layer, K and
V) with shuffled block ids, and a ragged batch built the way the engine builds one.

Shared by the in-process tests and by triton_interpret_check.py, which runs in a subprocess.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kernels.attention_reference import to_cache_dtype
from tandem.kernels.metadata import AttentionMetadata, KvCacheShape

LAYER = 1  # the layer under test; the cache has NUM_LAYERS so a write to the wrong layer shows
NUM_LAYERS = 3

# Batches as (cached context before this step, new tokens this step) per sequence.
DECODE_ONLY = [(0, 1), (15, 1), (16, 1), (31, 1), (47, 1), (100, 1), (5, 1), (63, 1)]
# Prefill chunks with and without earlier context, a chunk of one, decodes between them.
MIXED = [(40, 1), (0, 37), (9, 1), (21, 20), (64, 1), (16, 16), (0, 1), (50, 1), (3, 5), (17, 1)]
PREFILL_ONLY = [(0, 33), (20, 12)]
# Engine-sized: contexts up to ~600 (several CPU decode chunks at the default budget) and long chunks.
LONG_DECODE = [(ctx, 1) for ctx in range(17, 600, 37)]
LONG_MIXED = [(0, 200), *LONG_DECODE[:8], (300, 100)]
# The CPU backends' tests run each batch with each head layout; outputs within TOLERANCE of the reference.
BATCHES = {
    "decode_only": DECODE_ONLY,
    "mixed": MIXED,
    "prefill_only": PREFILL_ONLY,
    "long_decode": LONG_DECODE,
    "long_mixed": LONG_MIXED,
}
HEADS = {"mha": (4, 4), "gqa3": (6, 2), "smollm2": (9, 3)}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@dataclass
class PagedStep:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor  # (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    meta: AttentionMetadata
    scale: float

    def run(
        self, attention: Callable[..., torch.Tensor], kv_cache: torch.Tensor | None = None, **options: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention's output and the whole cache after it ran, on a copy of the step's cache
        (or on `kv_cache` when given); `options`: window and softcap."""
        kv_cache = self.kv_cache.clone() if kv_cache is None else kv_cache
        out = attention(self.q, self.k, self.v, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], self.meta, self.scale, **options)
        return out, kv_cache

    def expected_cache(self) -> torch.Tensor:
        """The cache after a backend wrote this step's k and v, written one token at a time."""
        expected = self.kv_cache.clone()
        block_size = self.kv_cache.shape[3]
        for token, slot in enumerate(self.meta.slot_mapping.tolist()):
            expected[slot // block_size, LAYER, 0, slot % block_size] = to_cache_dtype(self.k[token], expected.dtype)
            expected[slot // block_size, LAYER, 1, slot % block_size] = to_cache_dtype(self.v[token], expected.dtype)
        return expected


def make_step(
    chunks: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
    spare_blocks: int = 7,
    device: str = "cpu",
) -> PagedStep:
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [cached + new for cached, new in chunks]
    blocks_per_seq = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    # Shuffled ids: a sequence's blocks are scattered, never in order, and block 0 is in use.
    block_ids = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(chunks), max(blocks_per_seq) + 1, dtype=torch.int32)
    slots: list[int] = []
    for s, ((cached, new), count) in enumerate(zip(chunks, blocks_per_seq, strict=True)):
        table = [block_ids.pop() for _ in range(count)]
        block_tables[s, :count] = torch.tensor(table)
        slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(cached, cached + new)]

    shape = KvCacheShape(num_blocks, NUM_LAYERS, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape.as_tuple(), generator=generator).to(cache_dtype or dtype)
    num_tokens = len(slots)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    q_lens = torch.tensor([new for _, new in chunks])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(device, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(new for _, new in chunks),
        max_seq_len=max(seq_lens),
        is_decode_only=all(new == 1 for _, new in chunks),
    )
    return PagedStep(q.to(device), k.to(device), v.to(device), kv_cache.to(device), meta, head_dim**-0.5)


def fill_unowned_slots(step: PagedStep, value: float) -> torch.Tensor:
    """A copy of the step's cache whose slots no sequence owns (past a context's end in its last
    block, blocks nobody holds) hold `value`, in the layer under test."""
    kv_cache = step.kv_cache.clone()
    block_size = kv_cache.shape[3]
    is_owned = torch.zeros(kv_cache.shape[0], block_size, dtype=torch.bool, device=kv_cache.device)
    for s, seq_len in enumerate(step.meta.seq_lens.tolist()):
        blocks = step.meta.block_tables[s, : -(-seq_len // block_size)].long()
        is_owned[blocks] = True
        is_owned[blocks[-1], seq_len - (len(blocks) - 1) * block_size :] = False
    kv_cache[:, LAYER].transpose(1, 2)[~is_owned] = value
    return kv_cache
