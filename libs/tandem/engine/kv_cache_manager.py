"""What the scheduler asks of the KV cache, in tokens; the blocks and keys stay in here."""

from __future__ import annotations

from tandem.engine.block_hash import prefix_block_hashes
from tandem.engine.block_pool import BlockPool
from tandem.engine.sequence import Sequence


class KvCacheManager:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached prefix of a sequence without blocks; the tokens it covers.

        At least one token is always left to compute, so the step that finishes the prefill
        produces logits: a fully cached prompt recomputes its last block.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.seq_id}: already has blocks; look up a prefix only before admission")
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, max_hit_blocks)
        block_ids = self.pool.lookup(hashes)
        num_hit_tokens = len(block_ids) * self.block_size
        seq.attach_computed_blocks(block_ids, hashes[: len(block_ids)], num_hit_tokens)
        return num_hit_tokens

    def num_blocks_to_add(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_reserved_blocks: int = 0) -> bool:
        """Whether `num_new_tokens` more tokens fit while keeping `num_reserved_blocks` free."""
        return self.num_blocks_to_add(seq, num_new_tokens) <= self.pool.num_free_blocks - num_reserved_blocks

    def max_new_tokens(self, seq: Sequence, num_reserved_blocks: int = 0) -> int:
        """How many more tokens of `seq` fit in its blocks plus the free ones above the reserve."""
        num_blocks = len(seq.block_table) + max(0, self.pool.num_free_blocks - num_reserved_blocks)
        return max(0, num_blocks * self.block_size - seq.num_computed_tokens)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to cover num_computed_tokens + num_new_tokens; False if no room."""
        num_blocks = self.num_blocks_to_add(seq, num_new_tokens)
        if num_blocks > self.pool.num_free_blocks:
            return False
        seq.append_blocks(self.pool.allocate(num_blocks))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block that became full of computed tokens (prompt and output alike)."""
        num_full = seq.num_computed_tokens // self.block_size
        first = len(seq.block_hashes)
        if num_full <= first:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        tokens = seq.token_ids[first * self.block_size : num_full * self.block_size]
        hashes = prefix_block_hashes(
            tokens,
            tenant=seq.tenant,
            num_public_prefix_tokens=seq.num_public_prefix_tokens,
            block_size=self.block_size,
            parent_hash=parent,
            first_block_index=first,
        )
        for index, key in enumerate(hashes, start=first):
            self.pool.cache_block(seq.block_table[index], key, parent)
            seq.append_block_hash(key)
            parent = key

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks; its cached blocks stay findable until reused.

        Freed last block first, so a sequence's tail (least likely to be shared) sits nearer
        the free list's head and is reused before its prefix.
        """
        self.pool.free(reversed(seq.release_blocks()))

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        return prefix_block_hashes(
            seq.token_ids,
            tenant=seq.tenant,
            num_public_prefix_tokens=seq.num_public_prefix_tokens,
            block_size=self.block_size,
            num_blocks=num_blocks,
        )
