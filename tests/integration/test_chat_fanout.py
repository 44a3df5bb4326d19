"""Streams of one chat instance on a real redis-server: one feed (one log read, one reader lease)
per reply however many clients read it; identical complete sequences for all; a client that
stops reading is dropped and resumes losslessly while the others get everything; a late client
gets the backlog then live; nothing is left (feed, lease, reader connection) once the last client
leaves; a vanished log ends every client with reply_expired; and a reply added to a reader loop
blocked in its XREAD is read without waiting for that read to time out."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest_asyncio
import redis.asyncio as aioredis
from helpers import wait_until
from tokenlog.durable_redis import DurableRedis

from services.chat.attach_reads import AttachReads
from services.chat.auth import Authenticator
from services.chat.config import ChatConfig
from services.chat.fanout import open_fanout
from services.chat.key_ring import KeyRing
from services.chat.models_view import ModelsView
from services.chat.state import ChatState
from services.chat.stream_slots import StreamSlots
from services.chat.streaming import ReplyStreams
from tandem.bus import Bus, BusConfig
from tandem.bus.events import final_event
from tandem.devstack.proc import free_port
from tandem.store.sqlite import SqliteStore
from tandem.tokenlog import LogTail, LogUnavailable, ReplyGone, ReplyKeys, ReplyMeta, TailConfig, TokenLogWriter, create_reply
from tandem.v1.common_pb2 import FINISH_REASON_STOP
from tandem.v1.tokens_pb2 import TokenEvent

CONFIG = ChatConfig(
    system_prompt="",
    max_answer_tokens=64,
    prompt_budget_free=512,
    prompt_budget_plus=512,
    max_message_chars=1000,
    idempotency_ttl_s=60,
    stream_buffer_events=3,
    stream_readers=2,
)


@pytest_asyncio.fixture
async def state(redis_server, tmp_path) -> AsyncIterator[ChatState]:
    store = SqliteStore(tmp_path / "conversations.db")
    await store.start()
    redis = aioredis.from_url(redis_server.url, socket_timeout=10)
    fanout = open_fanout(CONFIG, redis_server.url, redis, "test-fanout")
    state = ChatState(
        config=CONFIG,
        auth=Authenticator(KeyRing.load({}, None)),
        store=store,
        redis=redis,
        fanout=fanout,
        attach_reads=AttachReads.of(redis, fanout, CONFIG),
        stream_slots=StreamSlots(CONFIG.max_streams, CONFIG.stream_limits()),
        bus=Bus(BusConfig(url="nats://127.0.0.1:1", name="unused")),
        models=ModelsView(),
    )
    yield state
    await state.fanout.close()
    await redis.aclose()
    await store.close()


class Client:
    """One SSE client: the events it has received, parsed from the bytes written to it."""

    def __init__(self, state: ChatState, reply_id: str, last_event_id: int = 0, meta: ReplyMeta | None = None) -> None:
        self.events: list[tuple[int, str, str]] = []
        self.stream = ReplyStreams.of(state.fanout, state.redis, state.store, state.config).sse_stream(
            reply_id, "m", last_event_id, meta=meta
        )

    async def read_one_write(self) -> None:
        self._parse(await anext(self.stream))

    async def read_to_end(self) -> list[tuple[int, str, str]]:
        async for chunk in self.stream:
            self._parse(chunk)
        return self.events

    def _parse(self, chunk: bytes) -> None:
        for block in chunk.decode().split("\r\n\r\n"):
            if block.strip():
                fields = dict(line.split(": ", 1) for line in block.split("\r\n"))
                self.events.append((int(fields["id"]), fields["event"], fields["data"]))

    @property
    def last_id(self) -> int:
        return self.events[-1][0] if self.events else 0


async def running_reply(redis: aioredis.Redis) -> tuple[str, TokenLogWriter]:
    reply_id = uuid.uuid4().hex
    await create_reply(redis, ReplyMeta(reply_id=reply_id, model="m"), track_readers=True)
    return reply_id, TokenLogWriter(redis, ttl_s=60)


async def write(writer: TokenLogWriter, reply_id: str, first: int, last: int) -> None:
    for seq in range(first, last + 1):
        await writer.append(TokenEvent(reply_id=reply_id, seq=seq, text=f"t{seq} "))


async def num_leases(state: ChatState, reply_id: str) -> int:
    return int(await state.redis.zcard(ReplyKeys(reply_id).readers))


async def test_many_clients_of_one_reply_get_identical_complete_sequences_from_one_feed_and_one_lease(state):
    reply_id, writer = await running_reply(state.redis)
    await write(writer, reply_id, 1, 2)
    clients = [Client(state, reply_id) for _ in range(200)]
    for client in clients:
        await client.read_one_write()  # meta
    tasks = [asyncio.create_task(client.read_to_end()) for client in clients]
    await wait_until(lambda: now(all(len(c.events) >= 3 for c in clients)))
    assert state.fanout.num_feeds == 1 and await num_leases(state, reply_id) == 1
    assert state.fanout.num_reader_connections <= CONFIG.stream_readers
    for seq in range(3, 21):
        await write(writer, reply_id, seq, seq)
        await wait_until(lambda seq=seq: now(all(c.last_id >= seq + 1 for c in clients)))  # no client falls behind
    await writer.append(final_event(reply_id, 21, FINISH_REASON_STOP))
    results = await asyncio.gather(*tasks)
    assert all(result == results[0] for result in results)
    assert [event_id for event_id, _, _ in results[0]] == list(range(1, 23))
    assert results[0][-1][1] == "done"
    await wait_until(lambda: now(state.fanout.num_feeds == 0))
    await wait_until(lambda: now(state.fanout.num_reader_connections == 0))


async def test_a_running_replys_meta_is_kept_by_its_feed_while_it_reads_and_forgotten_at_its_end(state):
    reply_id, writer = await running_reply(state.redis)
    meta = ReplyMeta(reply_id=reply_id, model="m", user_id="u1", conversation_id="c1")
    assert state.fanout.running_meta(reply_id) is None, "no feed reads it yet"
    first = Client(state, reply_id)  # one that read no meta
    await first.read_one_write()
    first_task = asyncio.create_task(first.read_to_end())
    await write(writer, reply_id, 1, 1)
    await wait_until(lambda: now(first.last_id >= 2))
    assert state.fanout.running_meta(reply_id) is None, "nobody gave the feed a meta"
    second = Client(state, reply_id, meta=meta)
    await second.read_one_write()
    second_task = asyncio.create_task(second.read_to_end())
    await wait_until(lambda: now(second.last_id >= 2))
    assert state.fanout.running_meta(reply_id) == meta
    assert state.fanout.running_meta(uuid.uuid4().hex) is None
    await writer.append(final_event(reply_id, 2, FINISH_REASON_STOP))
    await asyncio.gather(first_task, second_task)
    assert state.fanout.running_meta(reply_id) is None, "a reply whose final event was read is not running"


async def test_a_client_that_stops_reading_is_dropped_and_resumes_losslessly_while_the_other_gets_everything(state):
    reply_id, writer = await running_reply(state.redis)
    await write(writer, reply_id, 1, 1)
    stalled, reading = Client(state, reply_id), Client(state, reply_id)
    for client in (stalled, reading):
        await client.read_one_write()
        await client.read_one_write()  # meta, then seq 1: both attached
    reader = asyncio.create_task(reading.read_to_end())
    for seq in range(2, 11):  # far past the stalled client's buffer of 3
        await write(writer, reply_id, seq, seq)
        await wait_until(lambda seq=seq: now(reading.last_id >= seq + 1))
    await writer.append(final_event(reply_id, 11, FINISH_REASON_STOP))
    everything = await reader
    assert [e[0] for e in everything] == list(range(1, 13)) and everything[-1][1] == "done"
    dropped = await stalled.read_to_end()
    assert dropped[-1][1] == "delta", "its stream just ended, without a done or an error"
    resumed = await Client(state, reply_id, last_event_id=stalled.last_id).read_to_end()
    assert dropped + resumed == everything


async def test_a_late_client_gets_the_backlog_after_its_last_event_id_then_live(state):
    reply_id, writer = await running_reply(state.redis)
    first = Client(state, reply_id)
    await write(writer, reply_id, 1, 5)
    first_reader = asyncio.create_task(first.read_to_end())
    await wait_until(lambda: now(first.last_id >= 6))
    late = Client(state, reply_id, last_event_id=3)
    late_reader = asyncio.create_task(late.read_to_end())
    await wait_until(lambda: now(late.last_id >= 6))
    assert state.fanout.num_feeds == 1, "the late client joined the feed, from memory"
    await writer.append(final_event(reply_id, 6, FINISH_REASON_STOP))
    everything, after_three = await asyncio.gather(first_reader, late_reader)
    assert after_three == everything[3:]


async def test_the_feed_its_lease_and_its_reader_connection_are_gone_once_the_last_client_leaves(state):
    reply_id, writer = await running_reply(state.redis)
    await write(writer, reply_id, 1, 1)
    clients = [Client(state, reply_id) for _ in range(3)]
    tasks = [asyncio.create_task(c.read_to_end()) for c in clients]
    await wait_until(lambda: now(all(c.last_id >= 2 for c in clients)))
    assert await num_leases(state, reply_id) == 1
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)
    await write(writer, reply_id, 2, 2)
    await wait_until(lambda: now(all(c.last_id >= 3 for c in clients[1:])))
    assert state.fanout.num_feeds == 1, "the others still read"
    for task in tasks[1:]:  # the clients go away
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert state.fanout.num_feeds == 0
    await wait_until(lambda: num_leases_is_zero(state, reply_id))
    await wait_until(lambda: now(state.fanout.num_reader_connections == 0))


async def test_a_log_that_vanishes_ends_every_client_with_reply_expired(state):
    reply_id, writer = await running_reply(state.redis)
    await write(writer, reply_id, 1, 2)
    clients = [Client(state, reply_id) for _ in range(3)]
    tasks = [asyncio.create_task(c.read_to_end()) for c in clients]
    await wait_until(lambda: now(all(c.last_id >= 3 for c in clients)))
    await state.redis.delete(*ReplyKeys(reply_id).all())
    for events in await asyncio.gather(*tasks):
        assert [(e[0], e[1]) for e in events] == [(1, "meta"), (2, "delta"), (3, "delta"), (4, "error")]
        assert '"reply_expired"' in events[-1][2]
    assert await state.redis.exists(*ReplyKeys(reply_id).all()) == 0, "no lease outlives the reply"


class Recorder:
    def __init__(self) -> None:
        self.events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.ended: list[Exception | None] = []

    def deliver(self, events, is_caught_up: bool) -> None:
        for event in events:
            self.events.put_nowait(event)

    def end(self, error: Exception | None) -> None:
        self.ended.append(error)


async def is_blocked_in_xread(redis: aioredis.Redis) -> bool:
    clients = await redis.client_list()
    return any("b" in c["flags"] and c["cmd"] == "xread" for c in clients)


async def test_a_reply_added_to_a_loop_blocked_in_its_read_is_read_without_waiting_for_the_block_to_end(redis_server):
    redis = aioredis.from_url(redis_server.url, socket_timeout=10)
    tail = LogTail(TailConfig(redis_server.url, num_readers=1, block_ms=120_000), redis)
    first_id, first_writer = await running_reply(redis)
    second_id, second_writer = await running_reply(redis)
    first, second = Recorder(), Recorder()
    try:
        await tail.follow(first_id, first)
        await wait_until(lambda: is_blocked_in_xread(redis))
        await write(second_writer, second_id, 1, 1)
        await tail.follow(second_id, second)
        event = await asyncio.wait_for(second.events.get(), timeout=30)  # far less than the 120 s block
        assert (event.reply_id, event.seq) == (second_id, 1)
        await write(first_writer, first_id, 1, 1)
        assert (await asyncio.wait_for(first.events.get(), timeout=30)).seq == 1, "the first reply is still read"
        assert first.ended == second.ended == []
    finally:
        await tail.close()
        await redis.aclose()


async def test_a_tail_waits_through_a_redis_restart_and_loses_no_event(tmp_path):
    server = DurableRedis(tmp_path, free_port())
    server.start()
    redis = aioredis.from_url(server.url, socket_timeout=10)
    tail = LogTail(TailConfig(server.url, num_readers=1, block_ms=300), redis)
    recorder = Recorder()
    try:
        reply_id, writer = await running_reply(redis)
        await write(writer, reply_id, 1, 4)
        await tail.follow(reply_id, recorder)
        first_four = [await asyncio.wait_for(recorder.events.get(), 10) for _ in range(4)]
        server.stop()
        server.start()
        async with aioredis.from_url(server.url, socket_timeout=10) as fresh:  # the writer's own reconnect
            writer = TokenLogWriter(fresh, ttl_s=60)
            await write(writer, reply_id, 5, 7)
            await writer.append(final_event(reply_id, 8, FINISH_REASON_STOP))
        rest = [await asyncio.wait_for(recorder.events.get(), 30) for _ in range(4)]
        assert [e.seq for e in first_four + rest] == list(range(1, 9))
        await wait_until(lambda: now(recorder.ended == [None]))
    finally:
        await tail.close()
        await redis.aclose()
        server.stop()


async def test_a_tail_whose_redis_stays_gone_ends_its_logs_with_log_unavailable(tmp_path):
    server = DurableRedis(tmp_path, free_port())
    server.start()
    redis = aioredis.from_url(server.url, socket_timeout=2)
    tail = LogTail(TailConfig(server.url, num_readers=1, block_ms=200, unavailable_deadline_s=1.5), redis)
    recorder = Recorder()
    try:
        reply_id, _ = await running_reply(redis)
        await tail.follow(reply_id, recorder)
        await wait_until(lambda: is_blocked_in_xread(redis))
        server.stop()
        await wait_until(lambda: now(bool(recorder.ended)), timeout_s=20)
        assert len(recorder.ended) == 1 and isinstance(recorder.ended[0], LogUnavailable)
    finally:
        await tail.close()
        await redis.aclose()
        server.stop()


async def test_an_unreadable_entry_ends_its_reply_with_reply_gone_and_the_loop_reads_on(redis_server):
    """An entry no writer appends (here one without the event field) ends its reply's follow with
    ReplyGone after what came before it; the other reply on the same loop is still read."""
    redis = aioredis.from_url(redis_server.url, socket_timeout=10)
    tail = LogTail(TailConfig(redis_server.url, num_readers=1, block_ms=200), redis)
    broken_id, broken_writer = await running_reply(redis)
    other_id, other_writer = await running_reply(redis)
    broken, other = Recorder(), Recorder()
    try:
        await write(broken_writer, broken_id, 1, 1)
        await tail.follow(broken_id, broken)
        await tail.follow(other_id, other)
        assert (await asyncio.wait_for(broken.events.get(), timeout=30)).seq == 1
        await redis.xadd(ReplyKeys(broken_id).log, {"x": "not an event"})
        await wait_until(lambda: now(bool(broken.ended)), timeout_s=30)
        assert len(broken.ended) == 1 and isinstance(broken.ended[0], ReplyGone)
        await write(other_writer, other_id, 1, 2)
        assert [(await asyncio.wait_for(other.events.get(), timeout=30)).seq for _ in range(2)] == [1, 2]
        assert other.ended == [] and broken.events.empty()
    finally:
        await tail.close()
        await redis.aclose()


async def test_a_loop_that_fails_unexpectedly_ends_its_logs_with_log_unavailable(redis_server):
    """A read that fails with anything but a lost connection (here Redis's WRONGTYPE: a reply's log
    key replaced by a string) ends every log of the loop with LogUnavailable instead of leaving its
    readers waiting for events that no loop will read."""
    redis = aioredis.from_url(redis_server.url, socket_timeout=10)
    tail = LogTail(TailConfig(redis_server.url, num_readers=1, block_ms=200), redis)
    first_id, _ = await running_reply(redis)
    second_id, _ = await running_reply(redis)
    first, second = Recorder(), Recorder()
    try:
        await tail.follow(first_id, first)
        await tail.follow(second_id, second)
        await wait_until(lambda: is_blocked_in_xread(redis))
        await redis.set(ReplyKeys(first_id).log, "not a stream", ex=60)
        await wait_until(lambda: now(bool(first.ended) and bool(second.ended)), timeout_s=30)
        assert len(first.ended) == len(second.ended) == 1
        assert isinstance(first.ended[0], LogUnavailable) and isinstance(second.ended[0], LogUnavailable)
    finally:
        await tail.close()
        await redis.aclose()


async def num_leases_is_zero(state: ChatState, reply_id: str) -> bool:
    return await num_leases(state, reply_id) == 0


async def now(value: bool) -> bool:
    return value
