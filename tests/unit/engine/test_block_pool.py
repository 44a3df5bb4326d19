import pytest

from tandem.engine.block_hash import block_hash
from tandem.engine.block_pool import BlockPool, KvEventKind, NoFreeBlocks


def cached_block(pool: BlockPool, key: int, parent: int | None = None) -> int:
    """A freshly allocated block registered under `key`, still referenced once."""
    (block_id,) = pool.allocate(1)
    pool.cache_block(block_id, key, parent)
    return block_id


def test_a_block_returns_to_the_free_list_only_when_its_last_reference_is_dropped():
    pool = BlockPool(4)
    block_id = cached_block(pool, key=11)
    assert pool.lookup([11]) == [block_id]  # a second holder
    assert pool.num_free_blocks == 3
    pool.free([block_id])
    assert pool.num_free_blocks == 3  # one holder left
    pool.free([block_id])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="freed more often"):  # and it had exactly two
        pool.free([block_id])


def test_freeing_a_block_more_often_than_taken_is_an_error():
    pool = BlockPool(2)
    block_ids = pool.allocate(1)
    pool.free(block_ids)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(block_ids)


def test_allocating_more_than_is_free_says_how_many_are_free():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocks, match="asked for 2 KV blocks, 1 free of 3"):
        pool.allocate(2)


def test_allocation_reuses_the_least_recently_freed_block_first():
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2])
    pool.free([0])
    pool.free([3])
    assert pool.allocate(3) == [2, 0, 3]


def test_a_freed_cached_block_keeps_its_content_and_is_found_again():
    pool = BlockPool(4)
    block_id = cached_block(pool, key=42)
    pool.free([block_id])
    assert pool.num_free_blocks == 4  # free, though still cached
    assert pool.num_cached_blocks == 1
    assert pool.lookup([42]) == [block_id]
    assert pool.num_free_blocks == 3  # taken back out of the free list
    pool.free([block_id])
    assert pool.num_free_blocks == 4  # by one reference


def test_lookup_returns_the_longest_cached_prefix_only():
    pool = BlockPool(4)
    first, second, third = (cached_block(pool, key) for key in (1, 2, 3))
    assert pool.lookup([1, 2, 99, 3]) == [first, second]
    pool.free([third])
    assert pool.num_free_blocks == 2  # the block after the miss got no reference: its one holder let go


def test_reusing_a_cached_block_evicts_its_key_and_emits_a_removed_event():
    pool = BlockPool(1)
    block_id = cached_block(pool, key=7, parent=5)
    pool.free([block_id])
    assert [e.kind for e in pool.drain_events()] == [KvEventKind.STORED]
    assert pool.allocate(1) == [block_id]
    (removed,) = pool.drain_events()
    assert (removed.kind, removed.block_hash, removed.parent_hash, removed.num_tokens) == (KvEventKind.REMOVED, 7, 5, 16)
    assert pool.lookup([7]) == []
    assert pool.num_cached_blocks == 0


def test_stored_events_carry_chained_parent_hashes_and_increasing_ids():
    pool = BlockPool(4, block_size=4)
    first = block_hash(None, [1, 2, 3, 4], "t")
    second = block_hash(first, [5, 6, 7, 8], "t")
    cached_block(pool, first, None)
    cached_block(pool, second, first)
    events = pool.drain_events()
    assert [(e.kind, e.block_hash, e.parent_hash, e.num_tokens) for e in events] == [
        (KvEventKind.STORED, first, None, 4),
        (KvEventKind.STORED, second, first, 4),
    ]
    assert events[0].event_id < events[1].event_id
    assert pool.drain_events() == []
    cached_block(pool, block_hash(second, [9, 9, 9, 9], "t"), second)
    assert pool.drain_events()[0].event_id > events[1].event_id  # ids never restart


def test_the_same_content_cached_twice_keeps_the_first_copy_and_emits_once():
    pool = BlockPool(4)
    first = cached_block(pool, key=9)
    cached_block(pool, key=9)  # the same content in another block
    assert len(pool.drain_events()) == 1
    assert pool.num_cached_blocks == 1  # not the second copy
    assert pool.lookup([9]) == [first]


def test_only_a_block_in_use_can_be_cached():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="not in use"):
        pool.cache_block(0, 1, None)


def test_cached_blocks_freed_with_keep_are_reused_only_after_every_other_free_block():
    pool = BlockPool(4)
    kept, plain = cached_block(pool, key=11), cached_block(pool, key=12)
    (uncached,) = pool.allocate(1)
    pool.free([kept], keep=True)
    pool.free([plain, uncached], keep=True)  # plain is kept too; an uncached block has nothing to keep
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    assert pool.allocate(2) == [3, uncached]  # the never-used block, then the uncached one
    assert pool.lookup([11]) == [kept]  # a kept block is found, and taken back out of its list
    pool.free([kept], keep=True)
    assert pool.allocate(1) == [plain]  # only the kept blocks are left: least recently freed first
    removed = [e.block_hash for e in pool.drain_events() if e.kind is KvEventKind.REMOVED]
    assert removed == [12]
    assert pool.allocate(1) == [kept] and pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
