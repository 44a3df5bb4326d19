"""A worker's prefix cache on the bus: its block pool's events as numbered KvEvent messages on
`tandem.v1.kv.events.<worker_id>`, and its full state on request at `tandem.v1.kv.state.<worker_id>`.

Event ids run 1, 2, 3, ... per worker process, one per message, without gaps: a router that
sees a gap (or a heartbeat's kv_event_id ahead of what it has) asks for the full state.

Numbering happens where the pool's events are drained in order with the state, so a state is
exactly "as of" an event id: every message numbered up to it is reflected in the state, none after
it. With an engine thread that is the thread itself (`collect`, `snapshot`); with an engine
process, the loop, which receives the process's events before any call's result
(`collect_events`, `state_of`). The loop publishes the numbered messages, in order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from tandem.bus import encode, subjects
from tandem.engine.block_pool import CachedBlock, KvEventKind
from tandem.engine.block_pool import KvEvent as PoolEvent
from tandem.engine.engine import Engine
from tandem.v1.kv_pb2 import BlocksRemoved, BlocksStored, KvEvent, KvState, StoredBlock

log = logging.getLogger(__name__)

# Keeps one message far below NATS's default 1 MiB payload limit (about 22 bytes a block).
MAX_BLOCKS_PER_EVENT = 4096


def stored_block(block: CachedBlock | PoolEvent) -> StoredBlock:
    return StoredBlock(block_hash=block.block_hash, parent_hash=block.parent_hash or 0, num_tokens=block.num_tokens)


def to_messages(events: Sequence[PoolEvent], worker_id: str, first_event_id: int) -> list[KvEvent]:
    """Each run of consecutive pool events of one kind becomes one message (order kept, so a
    block stored, evicted and stored again ends up stored); message i gets first_event_id + i."""
    messages: list[KvEvent] = []
    for kind, run in itertools.groupby(events, key=lambda event: event.kind):
        batch = list(run)
        for start in range(0, len(batch), MAX_BLOCKS_PER_EVENT):
            chunk = batch[start : start + MAX_BLOCKS_PER_EVENT]
            message = KvEvent(worker_id=worker_id, event_id=first_event_id + len(messages))
            if kind is KvEventKind.STORED:
                message.stored.CopyFrom(BlocksStored(blocks=[stored_block(event) for event in chunk]))
            else:
                message.removed.CopyFrom(BlocksRemoved(block_hashes=[event.block_hash for event in chunk]))
            messages.append(message)
    return messages


def kv_state(worker_id: str, event_id: int, blocks: Iterable[CachedBlock]) -> KvState:
    return KvState(worker_id=worker_id, event_id=event_id, blocks=[stored_block(block) for block in blocks])


class KvEventPublisher:
    """One worker's KV events and state. `collect` and `snapshot` run on an engine thread (its
    after-change hook, and `call`); `collect_events` and `state_of` on the loop of a worker whose
    engine runs in a process (engine_process.py); the rest on the loop."""

    def __init__(self, worker_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self._worker_id = worker_id
        self._loop = loop
        self._num_numbered = 0  # engine thread only
        self._outbox: asyncio.Queue[list[KvEvent]] = asyncio.Queue()
        self.last_published_event_id = 0  # loop only; heartbeats carry it

    # -- where the events are drained ----------------------------------------------------------

    def collect(self, engine: Engine) -> None:
        """Drains the engine's KV events, numbers them and hands them to the loop to publish."""
        self.collect_events(engine.drain_kv_events())

    def collect_events(self, events: Sequence[PoolEvent]) -> None:
        """Numbers drained pool events and hands them to the loop to publish (from any thread)."""
        if not events:
            return
        messages = to_messages(events, self._worker_id, self._num_numbered + 1)
        self._num_numbered += len(messages)
        self._loop.call_soon_threadsafe(self._outbox.put_nowait, messages)

    def snapshot(self, engine: Engine) -> KvState:
        """Every cached block, as of the last event numbered (pending events are numbered first)."""
        self.collect(engine)
        return self.state_of(engine.cached_blocks())

    def state_of(self, blocks: Iterable[CachedBlock]) -> KvState:
        """`blocks`, the engine's cached blocks once every event before them is numbered."""
        return kv_state(self._worker_id, self._num_numbered, blocks)

    # -- loop -----------------------------------------------------------------------------------

    async def run(self, client: Client, is_ready: Callable[[], bool], snapshot: Callable[[], Awaitable[KvState]]) -> None:
        """Answers state requests (`snapshot` of the engine once `is_ready`) and publishes the
        numbered events, in order, until cancelled."""

        async def on_state_request(msg: Msg) -> None:
            if not msg.reply:
                return
            if is_ready():
                state = await snapshot()
            else:  # no engine, no pool: nothing cached, nothing numbered yet
                state = kv_state(self._worker_id, 0, ())
            await msg.respond(encode(state))

        await client.subscribe(subjects.kv_state(self._worker_id), cb=on_state_request)
        subject = subjects.kv_events(self._worker_id)
        while True:
            for message in await self._outbox.get():
                try:
                    await client.publish(subject, encode(message))
                except nats.errors.Error as exc:  # its id stays used: routers see a gap and ask for the state
                    log.warning("KV event %d not published: %s", message.event_id, exc or type(exc).__name__)
                self.last_published_event_id = message.event_id
