"""A worker's KV events as messages: runs of one kind batched, ids contiguous from 1 across
drains, and a state snapshot exactly as of the last id numbered."""

from __future__ import annotations

import asyncio

from tandem.engine.block_pool import BlockPool
from tandem.worker import kv_events
from tandem.worker.kv_events import KvEventPublisher, to_messages


class PoolOnly:
    """The things the publisher asks of an engine, on a real BlockPool."""

    def __init__(self, num_blocks: int = 4) -> None:
        self.pool = BlockPool(num_blocks, block_size=16)

    def drain_kv_events(self):
        return self.pool.drain_events()

    def cached_blocks(self):
        return self.pool.cached_blocks()

    def store(self, *keys: int, parent: int | None = None) -> list[int]:
        block_ids = self.pool.allocate(len(keys))
        for block_id, key in zip(block_ids, keys):
            self.pool.cache_block(block_id, key, parent)
            parent = key
        return block_ids


def test_runs_of_one_kind_share_a_message_in_order_with_contiguous_ids():
    engine = PoolOnly(num_blocks=3)
    engine.pool.free(engine.store(11, 12, 13))
    engine.store(21, 22)  # evicts 11 and 12 to make room, then stores two
    messages = to_messages(engine.drain_kv_events(), "d1", first_event_id=5)
    assert [m.event_id for m in messages] == [5, 6, 7]
    assert [m.WhichOneof("change") for m in messages] == ["stored", "removed", "stored"]
    assert {m.worker_id for m in messages} == {"d1"}
    first, removed, second = messages
    assert [(b.block_hash, b.parent_hash, b.num_tokens) for b in first.stored.blocks] == [(11, 0, 16), (12, 11, 16), (13, 12, 16)]
    assert list(removed.removed.block_hashes) == [11, 12]
    assert [(b.block_hash, b.parent_hash) for b in second.stored.blocks] == [(21, 0), (22, 21)]


def test_a_long_run_is_split_so_a_message_stays_small(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_BLOCKS_PER_EVENT", 2)
    engine = PoolOnly(num_blocks=5)
    engine.store(1, 2, 3, 4, 5)
    messages = to_messages(engine.drain_kv_events(), "d1", first_event_id=1)
    assert [[b.block_hash for b in m.stored.blocks] for m in messages] == [[1, 2], [3, 4], [5]]
    assert [m.event_id for m in messages] == [1, 2, 3]


def test_nothing_drained_publishes_nothing_and_takes_no_id():
    assert to_messages([], "d1", first_event_id=1) == []


async def test_ids_run_from_one_across_drains_and_a_snapshot_is_as_of_the_last_id():
    publisher = KvEventPublisher("d1", asyncio.get_running_loop())
    engine = PoolOnly(num_blocks=4)
    publisher.collect(engine)  # nothing yet
    engine.pool.free(engine.store(11, 12))
    publisher.collect(engine)
    engine.store(13, 14, 15)  # evicts 11, then stores
    state = publisher.snapshot(engine)  # numbers the pending events first
    # One batch per drain that found events, handed to the loop in order.
    batches = [await asyncio.wait_for(publisher._outbox.get(), 1) for _ in range(2)]
    assert publisher._outbox.empty()
    published = [m for batch in batches for m in batch]
    assert [m.event_id for m in published] == [1, 2, 3]
    assert [m.WhichOneof("change") for m in published] == ["stored", "removed", "stored"]
    assert (state.worker_id, state.event_id) == ("d1", 3)
    assert sorted((b.block_hash, b.parent_hash) for b in state.blocks) == [(12, 11), (13, 0), (14, 13), (15, 14)]
