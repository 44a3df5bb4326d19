"""What the engine asks of the KV cache, in tokens and sequences; the blocks and keys stay in here.

The KvCacheManager is the only door to the BlockPool: the scheduler grows and frees sequences'
block tables through it, the engine reserves and frees blocks for imports through it, and both
read the pool's counts and the prefix cache's events from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.block_hash import prefix_block_hashes
from tandem.engine.block_pool import BlockPool, CachedBlock, KvEvent, NoFreeBlocks
from tandem.engine.sequence import Lane, Sequence
from tandem.kernels.metadata import BLOCK_SIZE


@dataclass(frozen=True)
class ImportReservation:
    """Blocks held for a sequence about to be imported: the leading blocks of its tokens that this
    engine's prefix cache already has (a reference taken on each), then fresh ones for the rest,
    which the prefill side fills."""

    cached_block_ids: tuple[int, ...]
    cached_block_hashes: tuple[int, ...]
    new_block_ids: tuple[int, ...]

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.cached_block_ids + self.new_block_ids


class KvCacheManager:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        self._pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.num_prefix_query_tokens = 0  # tokens looked up in the prefix cache since start
        self.num_prefix_hit_tokens = 0  # of them, found cached

    # -- counts ---------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached or not."""
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix, in use or free."""
        return self._pool.num_cached_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def count_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """A lookup that took effect (an admission, an import's reservation): the hit rate's numbers."""
        self.num_prefix_query_tokens += num_query_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    # -- a scheduled sequence's blocks ----------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached prefix of a sequence without blocks; the tokens it covers.

        At least one token is always left to compute, so the step that finishes the prefill
        produces logits: a fully cached prompt recomputes its last block.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.seq_id}: already has blocks; look up a prefix only before admission")
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, max_hit_blocks)
        block_ids = self._pool.lookup(hashes)
        num_hit_tokens = len(block_ids) * self.block_size
        seq.attach_computed_blocks(block_ids, hashes[: len(block_ids)], num_hit_tokens)
        return num_hit_tokens

    def max_new_tokens(self, seq: Sequence, num_reserved_blocks: int = 0) -> int:
        """How many more tokens of `seq` fit in its blocks plus the free ones above the reserve."""
        num_blocks = len(seq.block_table) + max(0, self._pool.num_free_blocks - num_reserved_blocks)
        return max(0, num_blocks * self.block_size - seq.num_computed_tokens)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to cover num_computed_tokens + num_new_tokens; False if no room."""
        num_blocks = max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))
        if num_blocks > self._pool.num_free_blocks:
            return False
        seq.append_blocks(self._pool.allocate(num_blocks))
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
            self._pool.cache_block(seq.block_table[index], key, parent)
            seq.append_block_hash(key)
            parent = key

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks; its cached blocks stay findable until reused, a paid
        sequence's prompt blocks after every other free block (BlockPool's kept list).

        Freed last block first, so a sequence's tail (least likely to be shared) sits nearer
        the free list's head and is reused before its prefix.
        """
        num_kept = seq.num_prompt_tokens // self.block_size if seq.lane is Lane.PAID else 0
        block_ids = seq.release_blocks()
        self._pool.free(reversed(block_ids[num_kept:]))
        self._pool.free(reversed(block_ids[:num_kept]), keep=True)

    # -- imports (decode side of a handoff) -----------------------------------------------------

    def reserve_import(self, seq: Sequence, num_blocks: int) -> ImportReservation:
        """Hold `num_blocks` blocks for `seq`'s tokens: the cached prefix, then fresh blocks for the
        rest; raises NoFreeBlocks (holding nothing) when they do not fit. `seq` keeps no blocks."""
        self.find_cached_prefix(seq)
        num_cached = min(len(seq.block_table), num_blocks)
        cached_ids, cached_hashes = seq.block_table[:num_cached], seq.block_hashes[:num_cached]
        self._pool.free(seq.release_blocks()[num_cached:])
        try:
            new_ids = self._pool.allocate(num_blocks - num_cached)
        except NoFreeBlocks:
            self._pool.free(cached_ids)
            raise
        self.count_prefix_lookup(seq.num_tokens, num_cached * self.block_size)
        return ImportReservation(tuple(cached_ids), tuple(cached_hashes), tuple(new_ids))

    def cancel_import(self, reservation: ImportReservation) -> None:
        """Give back a reservation's blocks (its cached ones stay cached)."""
        self._pool.free(reservation.block_ids)

    # -- the prefix cache, for the router -------------------------------------------------------

    def drain_events(self) -> list[KvEvent]:
        """Blocks stored in and evicted from the prefix cache since the last drain."""
        return self._pool.drain_events()

    def cached_blocks(self) -> list[CachedBlock]:
        """Every block the prefix cache holds now, in use or free."""
        return self._pool.cached_blocks()

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        return prefix_block_hashes(
            seq.token_ids,
            tenant=seq.tenant,
            num_public_prefix_tokens=seq.num_public_prefix_tokens,
            block_size=self.block_size,
            num_blocks=num_blocks,
        )
