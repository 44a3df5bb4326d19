"""New streams' meta reads on a real redis-server: hundreds of streams attaching to one reply at
once cost one Redis read (the rest share it, or are answered from the feed's memory); reads of
many replies wait their turn in the bounded queue, and past its bound a stream is refused with
streams_busy; a Redis that is not there ends the read once the stream's wait is up."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from services.chat.attach_queue import AttachQueue
from services.chat.attach_reads import AttachReads
from services.chat.errors import Unavailable
from services.chat.fanout import FanoutHub
from tandem.devstack.proc import free_port
from tandem.tokenlog import LogTail, LogUnavailable, ReplyMeta, TailConfig, create_reply


@pytest_asyncio.fixture
async def redis(redis_server) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def fanout(redis, redis_server) -> AsyncIterator[FanoutHub]:
    hub = FanoutHub(LogTail(TailConfig(redis_server.url, num_readers=1), redis), redis, "test-attach", lease_s=15.0)
    yield hub
    await hub.close()


async def new_reply(redis: aioredis.Redis) -> str:
    reply_id = uuid.uuid4().hex
    await create_reply(redis, ReplyMeta(reply_id, user_id="alice", conversation_id="c1", model="m"), track_readers=False)
    return reply_id


async def hmget_calls(redis: aioredis.Redis) -> int:
    return int((await redis.info("commandstats")).get("cmdstat_hmget", {}).get("calls", 0))


async def test_500_streams_attaching_to_one_reply_at_once_cost_one_redis_read(redis, fanout):
    reads = AttachReads(redis, fanout, AttachQueue(max_reads=4, max_waiting=10), wait_s=10.0)
    reply_id = await new_reply(redis)
    before = await hmget_calls(redis)
    metas = await asyncio.gather(*(reads.meta(reply_id) for _ in range(500)))
    assert await hmget_calls(redis) - before == 1
    assert {(m.reply_id, m.user_id, m.model, m.is_running) for m in metas if m is not None} == {(reply_id, "alice", "m", True)}
    assert all(m is not None for m in metas)
    again = await reads.meta(reply_id)  # the flight has landed: a later stream reads again
    assert again == metas[0] and await hmget_calls(redis) - before == 2


async def test_a_reply_that_is_gone_is_none_for_every_stream_that_asked(redis, fanout):
    reads = AttachReads(redis, fanout, AttachQueue(max_reads=4, max_waiting=10), wait_s=10.0)
    assert await asyncio.gather(*(reads.meta(uuid.uuid4().hex) for _ in range(3))) == [None, None, None]


async def test_reads_of_many_replies_wait_their_turn_and_past_the_bound_a_stream_is_refused(redis, fanout):
    reads = AttachReads(redis, fanout, AttachQueue(max_reads=2, max_waiting=3), wait_s=10.0)
    reply_ids = [await new_reply(redis) for _ in range(8)]
    answers = await asyncio.gather(*(reads.meta(reply_id) for reply_id in reply_ids), return_exceptions=True)
    served = [a.reply_id for a in answers if isinstance(a, ReplyMeta)]
    refused = [a for a in answers if isinstance(a, Exception)]
    assert served == reply_ids[:5], "two read at once, three waited their turn"
    assert len(refused) == 3 and all(isinstance(e, Unavailable) and e.code == "streams_busy" for e in refused), refused


async def test_a_redis_that_is_not_there_ends_the_read_once_the_wait_is_up(fanout):
    gone = aioredis.from_url(f"redis://127.0.0.1:{free_port()}", socket_connect_timeout=0.2)
    try:
        reads = AttachReads(gone, fanout, AttachQueue(max_reads=2, max_waiting=3), wait_s=0.5)
        with pytest.raises(LogUnavailable):
            await asyncio.wait_for(reads.meta("any"), timeout=10)
    finally:
        await gone.aclose()
