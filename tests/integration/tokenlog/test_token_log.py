"""The token log on a real redis-server: ordered, idempotent, resumable, expiring."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from durable_redis import DurableRedis

from tandem.bus.events import ReplyStatus, error_event, now_ms
from tandem.devstack.proc import free_port
from tandem.tokenlog import (
    REPLY_SET_TTL_S,
    RUNNING,
    UNPERSISTED,
    LogUnavailable,
    ReplyGone,
    ReplyKeys,
    ReplyMeta,
    TokenLogWriter,
    attach,
    begin_continuation,
    create_reply,
    detach,
    fence_reply,
    idle_for_ms,
    load_reply,
    load_reply_states,
    read,
    set_answered,
)
from tandem.v1.common_pb2 import FINISH_REASON_CANCELLED, FINISH_REASON_STOP, Usage
from tandem.v1.tokens_pb2 import TokenEvent

TTL_S = 60


@pytest_asyncio.fixture
async def redis(redis_server):
    client = aioredis.from_url(redis_server.url, socket_timeout=10)
    yield client
    await client.aclose()


def events(reply_id: str, num: int, finish: int = FINISH_REASON_STOP) -> list[TokenEvent]:
    out = [TokenEvent(reply_id=reply_id, seq=i, token_id=100 + i, text=f"w{i} ") for i in range(1, num + 1)]
    out[-1].finish = finish
    out[-1].usage.CopyFrom(Usage(input_tokens=7, output_tokens=num))
    return out


async def read_all(redis, reply_id: str, after: int = 0) -> list[TokenEvent]:
    return [event async for event in read(redis, reply_id, after=after, block_ms=200)]


def new_id() -> str:
    return uuid.uuid4().hex


async def test_events_in_order_are_read_back_in_order_and_the_read_ends_at_the_final_one(redis):
    reply_id = new_id()
    writer = TokenLogWriter(redis, TTL_S)
    for event in events(reply_id, 5):
        await writer.append(event)
    logged = await read_all(redis, reply_id)
    assert [e.seq for e in logged] == [1, 2, 3, 4, 5]
    assert "".join(e.text for e in logged) == "w1 w2 w3 w4 w5 "
    assert logged[-1].usage.output_tokens == 5


async def test_a_duplicate_delivery_is_logged_once(redis):
    reply_id = new_id()
    writer = TokenLogWriter(redis, TTL_S)
    first, second, last = events(reply_id, 3)
    assert (await writer.append(first)).num_appended == 1
    assert (await writer.append(first)).num_appended == 0
    await writer.append(second)
    await writer.append(first)
    await writer.append(last)
    assert [e.seq for e in await read_all(redis, reply_id)] == [1, 2, 3]


async def test_an_event_ahead_of_a_gap_is_held_until_the_gap_fills(redis):
    reply_id = new_id()
    writer = TokenLogWriter(redis, TTL_S)
    e1, e2, e3, e4 = events(reply_id, 4)
    await writer.append(e1)
    held = await writer.append(e3)
    assert (held.num_appended, held.last_seq, held.num_held) == (0, 1, 1)
    await writer.append(e4)  # the final event, also held
    assert (await load_reply(redis, reply_id)).is_running
    filled = await writer.append(e2)
    assert (filled.num_appended, filled.last_seq, filled.final_status, filled.num_held) == (3, 4, ReplyStatus.COMPLETE, 0)
    assert [e.seq for e in await read_all(redis, reply_id)] == [1, 2, 3, 4]


async def test_two_writers_appending_a_shuffled_stream_log_it_in_order(redis_server, redis):
    reply_id = new_id()
    other = aioredis.from_url(redis_server.url)
    writers = [TokenLogWriter(redis, TTL_S), TokenLogWriter(other, TTL_S)]
    stream = events(reply_id, 60)
    deliveries = stream + random.Random(7).sample(stream, 20)  # duplicates too
    random.Random(11).shuffle(deliveries)
    await asyncio.gather(*(writers[i % 2].append(e) for i, e in enumerate(deliveries)))
    await other.aclose()
    logged = await read_all(redis, reply_id)
    assert [e.seq for e in logged] == list(range(1, 61))
    assert [e.token_id for e in logged] == [e.token_id for e in stream]


async def test_a_reader_resumes_after_the_seq_it_names(redis):
    reply_id = new_id()
    writer = TokenLogWriter(redis, TTL_S)
    for event in events(reply_id, 6):
        await writer.append(event)
    assert [e.seq for e in await read_all(redis, reply_id, after=4)] == [5, 6]
    assert await read_all(redis, reply_id, after=6) == []


async def test_a_reader_attached_before_the_tokens_gets_them_live(redis):
    reply_id = new_id()
    await create_reply(redis, ReplyMeta(reply_id=reply_id, user_id="u1"), track_readers=False)
    reader = asyncio.create_task(read_all(redis, reply_id))
    writer = TokenLogWriter(redis, TTL_S)
    for event in events(reply_id, 4):
        await writer.append(event)
    logged = await asyncio.wait_for(reader, 10)
    assert [e.seq for e in logged] == [1, 2, 3, 4]


async def test_the_final_event_closes_the_log_and_starts_its_expiry(redis):
    reply_id = new_id()
    await create_reply(redis, ReplyMeta(reply_id=reply_id, user_id="u1", conversation_id="c1"), track_readers=False)
    writer = TokenLogWriter(redis, TTL_S)
    stream = events(reply_id, 3, finish=FINISH_REASON_CANCELLED)
    for event in stream:
        await writer.append(event)
    late = TokenEvent(reply_id=reply_id, seq=4, token_id=1, text="late")
    assert (await writer.append(late)).num_appended == 0
    meta = await load_reply(redis, reply_id)
    assert (meta.status, meta.last_seq, meta.conversation_id) == (ReplyStatus.STOPPED, 3, "c1")
    assert meta.finished_ms >= meta.created_ms > 0
    keys = ReplyKeys(reply_id)
    assert 0 < await redis.ttl(keys.log) <= TTL_S
    assert 0 < await redis.ttl(keys.meta) <= TTL_S


async def test_a_running_reply_expires_only_after_its_running_ttl_which_every_event_pushes_back(redis):
    reply_id = new_id()
    await create_reply(redis, ReplyMeta(reply_id=reply_id), track_readers=False, ttl_s=500)
    keys = ReplyKeys(reply_id)
    assert 0 < await redis.ttl(keys.meta) <= 500
    writer = TokenLogWriter(redis, TTL_S, running_ttl_s=3000)
    first, _, third = events(reply_id, 3)
    await writer.append(first)
    await writer.append(third)  # held: the pending hash gets the running expiry too
    for key in (keys.log, keys.meta, keys.pending):
        assert 500 < await redis.ttl(key) <= 3000


async def test_a_record_the_first_event_creates_expires_too(redis):
    reply_id = new_id()  # a bus client's reply: nobody called create_reply
    await TokenLogWriter(redis, TTL_S, running_ttl_s=900).append(events(reply_id, 3)[0])
    for key in (ReplyKeys(reply_id).log, ReplyKeys(reply_id).meta):
        assert 0 < await redis.ttl(key) <= 900


async def test_every_reply_created_is_running_and_only_tracked_ones_say_so(redis):
    tracked, untracked = new_id(), new_id()
    await create_reply(redis, ReplyMeta(reply_id=tracked), track_readers=True)
    await create_reply(redis, ReplyMeta(reply_id=untracked), track_readers=False)
    assert await redis.smismember(RUNNING, [tracked, untracked]) == [1, 1]
    assert (await load_reply(redis, tracked)).is_tracking_readers
    assert not (await load_reply(redis, untracked)).is_tracking_readers
    assert 0 < await redis.ttl(RUNNING) <= REPLY_SET_TTL_S


async def test_the_final_append_moves_the_reply_from_running_to_unpersisted_in_one_step(redis):
    reply_id = new_id()
    await create_reply(redis, ReplyMeta(reply_id=reply_id, conversation_id="c1", message_id=reply_id), track_readers=False)
    writer = TokenLogWriter(redis, TTL_S)
    first, last = events(reply_id, 2)
    await writer.append(first)
    assert (await redis.sismember(RUNNING, reply_id), await redis.sismember(UNPERSISTED, reply_id)) == (1, 0)
    assert (await writer.append(last)).final_status == ReplyStatus.COMPLETE
    assert (await redis.sismember(RUNNING, reply_id), await redis.sismember(UNPERSISTED, reply_id)) == (0, 1)
    assert 0 < await redis.ttl(UNPERSISTED) <= REPLY_SET_TTL_S
    repeated = await writer.append(last)  # a redelivery after the relay died: nothing changes
    assert (repeated.num_appended, repeated.final_status) == (0, None)
    assert await redis.sismember(UNPERSISTED, reply_id) == 1


async def test_a_continuation_bumps_the_epoch_and_the_old_owners_events_are_dropped(redis):
    reply_id = new_id()
    await create_reply(redis, ReplyMeta(reply_id=reply_id), track_readers=False)
    writer = TokenLogWriter(redis, TTL_S)
    old = events(reply_id, 6)
    for event in old[:3]:
        await writer.append(event)
    await writer.append(old[4])  # held behind the gap at seq 4: the old owner's, forgotten on take-over
    continuation = await begin_continuation(redis, reply_id, expected_epoch=0, expected_last_seq=3)
    assert continuation == (1, [101, 102, 103])
    meta = await load_reply(redis, reply_id)
    assert (meta.epoch, meta.num_continuations, meta.gap_since_ms) == (1, 1, 0)
    assert meta.continued_ms >= meta.created_ms
    assert await redis.exists(ReplyKeys(reply_id).pending) == 0
    stale = await writer.append(old[3])  # the old owner's seq 4 arrives late
    assert (stale.num_appended, stale.is_stale) == (0, True)
    new = [TokenEvent(reply_id=reply_id, seq=i, token_id=200 + i, text=f"n{i} ", epoch=1) for i in (4, 5)]
    new[-1].finish = FINISH_REASON_STOP
    for event in new:
        assert (await writer.append(event)).num_appended == 1
    logged = await read_all(redis, reply_id)
    assert [(e.seq, e.epoch) for e in logged] == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1)]


async def test_only_one_of_two_relays_continues_a_reply(redis):
    reply_id = new_id()
    await create_reply(redis, ReplyMeta(reply_id=reply_id), track_readers=False)
    outcomes = await asyncio.gather(*(begin_continuation(redis, reply_id, expected_epoch=0) for _ in range(2)))
    assert sorted(outcomes, key=lambda c: c is None) == [(1, []), None]
    assert await begin_continuation(redis, reply_id, expected_epoch=1, expected_last_seq=2) is None  # it made progress meanwhile


async def test_a_finished_reply_is_never_continued_and_a_fenced_one_takes_only_the_fencers_event(redis):
    done, fenced = new_id(), new_id()
    writer = TokenLogWriter(redis, TTL_S)
    for event in events(done, 2):
        await writer.append(event)
    assert await begin_continuation(redis, done) is None
    await create_reply(redis, ReplyMeta(reply_id=fenced), track_readers=False)
    await writer.append(events(fenced, 3)[0])
    taken = await fence_reply(redis, fenced, expected_epoch=0)
    assert taken == (1, 1)
    assert (await load_reply(redis, fenced)).num_continuations == 0
    assert (await writer.append(events(fenced, 3)[1])).is_stale
    failed = error_event(fenced, taken.last_seq + 1, "worker_lost", "retry")
    failed.epoch = taken.epoch
    assert (await writer.append(failed)).final_status == ReplyStatus.FAILED


async def test_every_key_a_run_of_replies_leaves_has_an_expiry(redis):
    writer = TokenLogWriter(redis, TTL_S)
    reply_ids = [new_id() for _ in range(6)]
    for i, reply_id in enumerate(reply_ids):
        await create_reply(redis, ReplyMeta(reply_id=reply_id, conversation_id="c"), track_readers=i % 2 == 0)
        await attach(redis, reply_id, "reader", lease_s=5)
        stream = events(reply_id, 4)
        for event in stream[: 4 if i < 3 else 1] + ([stream[2]] if i == 5 else []):
            await writer.append(event)
        if i:
            await detach(redis, reply_id, "reader")  # the first keeps its reader
    await begin_continuation(redis, reply_ids[4])
    keys = [key for reply_id in reply_ids async for key in redis.scan_iter(match=f"*{{{reply_id}}}*")]
    assert len(keys) == 6 * 2 + 2  # meta and log each, one pending hash, one readers set (the others emptied on detach)
    for key in [*keys, RUNNING, UNPERSISTED]:
        assert await redis.ttl(key) > 0, key


async def test_reading_an_unknown_reply_raises_reply_gone(redis):
    with pytest.raises(ReplyGone):
        await read_all(redis, new_id())


async def test_the_request_is_kept_for_a_continuation(redis):
    from tandem.v1.generate_pb2 import GenerateRequest

    reply_id = new_id()
    request = GenerateRequest(reply_id=reply_id, prompt_token_ids=[1, 2, 3], conversation_id="c9")
    await create_reply(redis, ReplyMeta(reply_id=reply_id, request=request.SerializeToString()), track_readers=True)
    assert GenerateRequest.FromString((await load_reply(redis, reply_id)).request) == request


async def test_a_reply_is_idle_only_once_every_reader_lease_is_gone(redis):
    reply_id = new_id()
    await create_reply(redis, ReplyMeta(reply_id=reply_id), track_readers=True)
    await attach(redis, reply_id, "reader-a", lease_s=30)
    await attach(redis, reply_id, "reader-b", lease_s=30)
    await detach(redis, reply_id, "reader-a")
    assert await idle_for_ms(redis, reply_id) == 0
    await detach(redis, reply_id, "reader-b")
    # Nobody reads now; pretend the last one left 5 s ago.
    await redis.hset(ReplyKeys(reply_id).meta, "last_reader_ms", now_ms() - 5000)
    assert await idle_for_ms(redis, reply_id) >= 5000


async def test_a_dead_readers_lease_runs_out(redis):
    reply_id = new_id()
    await create_reply(redis, ReplyMeta(reply_id=reply_id), track_readers=True)
    await redis.zadd(ReplyKeys(reply_id).readers, {"crashed": now_ms() - 3000})
    await redis.hset(ReplyKeys(reply_id).meta, "last_reader_ms", now_ms() - 10000)
    assert 3000 <= await idle_for_ms(redis, reply_id) < 6000  # since the lease ran out, not since the last detach


async def test_a_detach_after_expiry_leaves_no_key(redis):
    reply_id = new_id()
    await detach(redis, reply_id, "late-reader")
    assert await redis.exists(ReplyKeys(reply_id).meta) == 0


async def test_logged_events_is_what_the_log_holds_now_without_waiting(redis):
    from tandem.tokenlog import logged_events

    reply_id = new_id()
    writer = TokenLogWriter(redis, TTL_S)
    first, second, third = events(reply_id, 3)
    await writer.append(first)
    await writer.append(third)  # held behind the gap: not in the log yet
    assert [e.seq for e in await logged_events(redis, reply_id)] == [1]
    await writer.append(second)
    assert [e.text for e in await logged_events(redis, reply_id)] == ["w1 ", "w2 ", "w3 "]
    assert await logged_events(redis, new_id()) == []


async def test_a_reader_waits_through_a_redis_restart_and_loses_no_event(tmp_path):
    server = DurableRedis(tmp_path, free_port())
    server.start()
    client = aioredis.from_url(server.url, socket_timeout=10)
    try:
        reply_id = new_id()
        await create_reply(client, ReplyMeta(reply_id=reply_id), track_readers=False)
        stream = events(reply_id, 8)
        writer = TokenLogWriter(client, TTL_S)
        for event in stream[:4]:
            await writer.append(event)
        first_four = asyncio.Event()

        async def read_noting_progress() -> list[TokenEvent]:
            out = []
            async for event in read(client, reply_id, block_ms=300):
                out.append(event)
                if len(out) == 4:
                    first_four.set()
            return out

        reader = asyncio.create_task(read_noting_progress())
        await asyncio.wait_for(first_four.wait(), 10)
        server.stop()
        server.start()
        for event in stream[4:]:
            await writer.append(event)
        logged = await asyncio.wait_for(reader, 30)
        assert [e.seq for e in logged] == list(range(1, 9))
    finally:
        await client.aclose()
        server.stop()


async def test_a_reader_whose_redis_stays_gone_ends_with_log_unavailable(tmp_path):
    server = DurableRedis(tmp_path, free_port())
    server.start()
    client = aioredis.from_url(server.url, socket_timeout=2)
    try:
        reply_id = new_id()
        await create_reply(client, ReplyMeta(reply_id=reply_id), track_readers=False)
        server.stop()
        with pytest.raises(LogUnavailable):
            await asyncio.wait_for(read_all_within(client, reply_id, deadline_s=1.5), 20)
    finally:
        await client.aclose()
        server.stop()


async def read_all_within(redis, reply_id: str, deadline_s: float) -> list[TokenEvent]:
    return [event async for event in read(redis, reply_id, block_ms=200, unavailable_deadline_s=deadline_s)]


async def test_the_states_of_many_replies_come_in_one_read_without_their_requests(redis):
    running, done, unknown = new_id(), new_id(), new_id()
    await create_reply(redis, ReplyMeta(reply_id=running, request=b"x" * 1000), track_readers=True)
    writer = TokenLogWriter(redis, TTL_S)
    await writer.append(events(running, 2)[0])
    for event in events(done, 2):
        await writer.append(event)
    states = await load_reply_states(redis, [running, done, unknown])
    assert states[unknown] is None
    assert (states[running].status, states[running].last_seq, states[running].is_tracking_readers) == (ReplyStatus.RUNNING, 1, True)
    assert states[running].last_event_ms >= states[running].created_ms > 0
    assert states[running].request == b""
    assert (states[done].status, states[done].last_seq) == (ReplyStatus.COMPLETE, 2)


async def test_a_reply_loaded_without_its_request_has_every_other_field(redis):
    reply_id = new_id()
    meta = ReplyMeta(
        reply_id=reply_id, user_id="u1", conversation_id="c1", message_id=reply_id, model="m", request=b"x" * 1000, num_dropped_turns=3
    )
    await create_reply(redis, meta, track_readers=True)
    await TokenLogWriter(redis, TTL_S).append(events(reply_id, 2)[0])
    await set_answered(redis, reply_id, "m2", '{"reason": "auto"}')
    whole, lean = await load_reply(redis, reply_id), await load_reply(redis, reply_id, with_request=False)
    assert whole.request == b"x" * 1000 and lean.request == b""
    assert dataclasses.replace(whole, request=b"") == lean
    assert (lean.user_id, lean.conversation_id, lean.num_dropped_turns, lean.last_seq, lean.model) == ("u1", "c1", 3, 1, "m2")
    assert lean.route_json == '{"reason": "auto"}'
    assert await load_reply(redis, new_id(), with_request=False) is None
