"""The fixed pool of KV blocks: reference counts, an LRU free list, the prefix cache, KV events.

A block is in use while its reference count is above zero. When the count drops to zero it goes
to the tail of the free list but keeps its content and its key, so a later request with the same
prefix finds it again (`lookup` takes it back out of the free list). Allocation takes from the
head, the least recently freed block; only then is its key evicted. Every block newly stored in
the cache and every cached block evicted is recorded as a KvEvent for the router.

A cached block its last holder frees with `keep` (the engine's paid sequences' prompt blocks)
goes to a second free list, taken from only once the first is empty: under an overload, free
work reuses its own freed blocks, paid answers' and the uncached ones first, and paid users keep
their cached prefixes (their conversations' turns, the start of their prompts). With one LRU
list the free flood evicted them: in bench/overload.py far fewer paid prompt tokens came from
the cache under the overload than with paid alone. (Keeping paid answers' blocks too hardly
helped: each paid reply's own blocks pushed the prompts out.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from enum import Enum

from tandem.kernels.metadata import BLOCK_SIZE


class NoFreeBlocks(RuntimeError):
    pass


class KvEventKind(str, Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class KvEvent:
    event_id: int  # increases by one per event, per pool
    kind: KvEventKind
    block_hash: int
    parent_hash: int | None
    num_tokens: int


@dataclass(frozen=True)
class CachedBlock:
    block_hash: int
    parent_hash: int | None
    num_tokens: int


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = next to reuse
        self._kept: OrderedDict[int, None] = OrderedDict()  # cached blocks freed with `keep`: reused after every other
        self._entry_of_block: dict[int, CachedBlock] = {}
        self._block_of_hash: dict[int, int] = {}
        self._events: list[KvEvent] = []
        self._next_event_id = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached or not."""
        return len(self._free) + len(self._kept)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix, in use or free."""
        return len(self._block_of_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free list (then of the kept one),
        evicting their cached keys."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocks(f"asked for {num_blocks} KV blocks, {self.num_free_blocks} free of {self.num_blocks}")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = (self._free or self._kept).popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int], keep: bool = False) -> None:
        """Drop one reference from each; blocks reaching zero go to the free list's tail in order,
        or with `keep`, those holding a cached prefix to the kept list's."""
        for block_id in block_ids:
            if self._ref_counts[block_id] < 1:
                raise RuntimeError(f"KV block {block_id} freed more often than it was taken")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                (self._kept if keep and block_id in self._entry_of_block else self._free)[block_id] = None

    def lookup(self, block_hashes: SequenceOf[int]) -> list[int]:
        """Blocks of the longest cached prefix of `block_hashes`, each with a reference taken."""
        block_ids = []
        for key in block_hashes:
            block_id = self._block_of_hash.get(key)
            if block_id is None:
                break
            if self._ref_counts[block_id] == 0:
                del (self._free if block_id in self._free else self._kept)[block_id]
            self._ref_counts[block_id] += 1
            block_ids.append(block_id)
        return block_ids

    def cache_block(self, block_id: int, block_hash: int, parent_hash: int | None) -> None:
        """Register a full, in-use block under its key (a no-op if that key is already cached)."""
        if self._ref_counts[block_id] < 1:
            raise RuntimeError(f"KV block {block_id} is not in use; only a filled block can be cached")
        if block_hash in self._block_of_hash or block_id in self._entry_of_block:
            return  # the same content computed twice (two requests at once): keep the first copy
        self._entry_of_block[block_id] = CachedBlock(block_hash, parent_hash, self.block_size)
        self._block_of_hash[block_hash] = block_id
        self._record(KvEventKind.STORED, self._entry_of_block[block_id])

    def cached_blocks(self) -> list[CachedBlock]:
        """Every block the prefix cache holds now, in use or free (for a full-state answer)."""
        return list(self._entry_of_block.values())

    def drain_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block_id: int) -> None:
        entry = self._entry_of_block.pop(block_id, None)
        if entry is not None:
            del self._block_of_hash[entry.block_hash]
            self._record(KvEventKind.REMOVED, entry)

    def _record(self, kind: KvEventKind, entry: CachedBlock) -> None:
        self._events.append(KvEvent(self._next_event_id, kind, entry.block_hash, entry.parent_hash, entry.num_tokens))
        self._next_event_id += 1
