"""A worker's TokenBatch through the relay's consumer and appender into the token log, on a
nats-server and a redis-server of the test's own: every reply's events land in its log in order,
one pipelined call per batch; a batch the log failed part way is handed back whole and
redelivered, and the log holds each event once; a batch published twice (a retry) is stored once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from helpers import wait_until
from nats.aio.client import Client
from redis.exceptions import ConnectionError as RedisConnectionError

from services.relay.appender import LogAppender
from services.relay.consumer import TokenConsumer, TokenConsumerConfig
from tandem.bus.token_batches import BatchNumbers, batches, publish_batch
from tandem.bus.token_stream import STREAM, ensure_token_stream
from tandem.devstack.servers import EmbeddedServer, start_nats, start_redis
from tandem.tokenlog import TokenLogWriter, load_reply, logged_events
from tandem.v1.common_pb2 import FINISH_REASON_STOP, Usage
from tandem.v1.tokens_pb2 import TokenEvent

WORKER = "decode-batch-test"
NUM_REPLIES = 5
NUM_TOKENS = 6


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, EmbeddedServer]]:
    bus, redis_server = start_nats(tmp_path / "nats"), start_redis(tmp_path / "redis")
    yield bus, redis_server
    bus.stop()
    redis_server.stop()


class FailsOnce:
    """The relay's appender, with a Redis that fails once part way through a batch: the first
    batch it is given has its first half logged, then the call raises as a dropped connection does."""

    def __init__(self, appender: LogAppender, writer: TokenLogWriter) -> None:
        self._appender = appender
        self._writer = writer
        self.num_calls = 0

    async def append(self, events: list[TokenEvent]) -> None:
        self.num_calls += 1
        if self.num_calls == 1:
            await self._writer.append_many(events[: len(events) // 2])
            raise RedisConnectionError("connection lost part way through a batch")
        await self._appender.append(events)


class Relay:
    def __init__(self, client: Client, redis: aioredis.Redis) -> None:
        self.writer = TokenLogWriter(redis, ttl_s=60, running_ttl_s=60)
        self.finished: list[str] = []
        self.handler = FailsOnce(LogAppender(self.writer, None, lambda event: self.finished.append(event.reply_id)), self.writer)
        config = TokenConsumerConfig(durable="relay-batches", heartbeat_s=0.2, expires_s=6.0, nak_delay_s=0.1, retry_s=0.1)
        self.task = asyncio.create_task(TokenConsumer(client, self.handler.append, config).run())


@pytest_asyncio.fixture
async def relay(servers) -> AsyncIterator[tuple[Client, aioredis.Redis, Relay]]:
    bus, redis_server = servers
    client = await nats.connect(bus.url)
    redis = aioredis.from_url(redis_server.url)
    await ensure_token_stream(client)
    running = Relay(client, redis)
    yield client, redis, running
    running.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running.task
    await redis.aclose()
    await client.close()


def _step_events(reply_ids: list[str]) -> list[TokenEvent]:
    """As a worker's steps make them: every reply's token of step 1, then of step 2, ...; the
    first reply ends with the last step."""
    events = []
    for seq in range(1, NUM_TOKENS + 1):
        for i, reply_id in enumerate(reply_ids):
            event = TokenEvent(reply_id=reply_id, seq=seq, token_id=seq, text=f"{reply_id[:4]}-{seq} ", worker_id=WORKER)
            if i == 0 and seq == NUM_TOKENS:
                event.finish = FINISH_REASON_STOP
                event.usage.CopyFrom(Usage(output_tokens=NUM_TOKENS))
            events.append(event)
    return events


async def _logged_seqs(redis: aioredis.Redis, reply_id: str) -> list[int]:
    return [event.seq for event in await logged_events(redis, reply_id)]


async def test_a_batch_across_replies_lands_in_order_and_its_redelivery_after_a_failure_part_way_adds_nothing(relay):
    client, redis, running = relay
    reply_ids = [f"r-{uuid.uuid4().hex[:12]}" for _ in range(NUM_REPLIES)]
    events = _step_events(reply_ids)
    [batch] = list(batches(WORKER, events))
    await publish_batch(client.jetstream(), batch, BatchNumbers(WORKER).next_id())

    async def all_logged() -> bool:
        return all([len(await _logged_seqs(redis, r)) == NUM_TOKENS for r in reply_ids])

    await wait_until(all_logged, timeout_s=20)
    assert running.handler.num_calls == 2, "the batch failed part way was handed back and delivered again"
    for reply_id in reply_ids:
        logged = await logged_events(redis, reply_id)
        assert [event.seq for event in logged] == list(range(1, NUM_TOKENS + 1)), reply_id
        assert "".join(event.text for event in logged) == "".join(f"{reply_id[:4]}-{seq} " for seq in range(1, NUM_TOKENS + 1))
    meta = await load_reply(redis, reply_ids[0])
    assert meta is not None and not meta.is_running and meta.last_seq == NUM_TOKENS
    assert running.finished == [reply_ids[0]], "the final event's hook runs once, on the append that closed the log"
    assert (await load_reply(redis, reply_ids[1])).is_running  # type: ignore[union-attr]

    async def stream_empty() -> bool:  # acknowledged, so the work queue let it go
        return (await client.jetstream().stream_info(STREAM)).state.messages == 0

    await wait_until(stream_empty, timeout_s=10)


async def test_a_batch_published_again_with_its_message_id_is_stored_once_and_a_copy_under_another_is_dropped_by_the_log(relay):
    client, redis, running = relay
    reply_ids = [f"r-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    [batch] = list(batches(WORKER, _step_events(reply_ids)))
    js = client.jetstream()
    numbers = BatchNumbers(WORKER)
    message_id = numbers.next_id()
    first = await js.publish("tandem.v1.tokens.batch." + WORKER, batch.SerializeToString(), headers={"Nats-Msg-Id": message_id})
    await publish_batch(js, batch, message_id)  # a retry after a lost acknowledgement
    again = await js.publish("tandem.v1.tokens.batch." + WORKER, batch.SerializeToString(), headers={"Nats-Msg-Id": message_id})
    assert again.duplicate and again.seq == first.seq
    await publish_batch(js, batch, numbers.next_id())  # the same events under a new id: delivered, dropped by the log

    async def settled() -> bool:
        return running.handler.num_calls >= 3 and (await js.stream_info(STREAM)).state.messages == 0

    await wait_until(settled, timeout_s=20)
    assert running.handler.num_calls == 3  # two messages stored; the first's delivery failed part way and came again
    for reply_id in reply_ids:
        assert await _logged_seqs(redis, reply_id) == list(range(1, NUM_TOKENS + 1))
    assert running.finished == [reply_ids[0]]
