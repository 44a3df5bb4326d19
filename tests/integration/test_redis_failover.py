"""Redis with failover under the relay's consumer (tandem.devstack.redis_ha, tandem.redis_sentinel,
tandem.tokenlog.replicated): a Sentinel set (primary, two replicas, three sentinels, fast
timings) and the relay's own pieces in this process (TokenConsumer, TokenLogWriter, the WAIT
after each append) on a NATS of the module's own. The primary is killed with -9 mid-stream:
the sentinels promote a replica, every event ends up logged once, in order, on the new primary
(an acknowledged one lost would leave a gap the log never fills), a reader following the log
rides the failover, and a quota reservation made before it is still there."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from followed_log import Collect
from helpers import wait_until
from nats.aio.client import Client

from services.relay.consumer import TokenConsumer, TokenConsumerConfig
from tandem.bus.token_stream import ensure_token_stream, publish_token
from tandem.config import Settings, Tier
from tandem.devstack.redis_ha import RedisHA, SentinelTiming, start_redis_ha
from tandem.devstack.servers import start_nats
from tandem.quota import QuotaConfig, TokenBuckets
from tandem.runtime.runtime import RuntimeConfig, redis_login, short_command_client
from tandem.tokenlog import LogTail, TailConfig, TokenLogWriter, load_reply, logged_events
from tandem.tokenlog.replicated import NotReplicated, ReplicationConfig, on_replicas
from tandem.v1.common_pb2 import FINISH_REASON_STOP
from tandem.v1.tokens_pb2 import TokenEvent

TIMING = SentinelTiming(down_after_ms=1000, failover_timeout_ms=3000)
NUM_REPLIES = 4
NUM_TOKENS = 150
STEP_S = 0.02  # the pace of a decode step: one token per reply
WAIT = ReplicationConfig(num_replicas=1, timeout_ms=500)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("redis-failover")


@pytest.fixture(scope="module")
def nats_url(workdir) -> Iterator[str]:
    server = start_nats(workdir)
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def ha(workdir) -> Iterator[RedisHA]:
    started = start_redis_ha(workdir, num_replicas=2, timing=TIMING)
    yield started
    started.stop()


@pytest_asyncio.fixture
async def nc(nats_url) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest_asyncio.fixture
async def redis(ha) -> AsyncIterator[aioredis.Redis]:
    """The relay's and chat's short-command client, from the settings `tandem up --ha` gives them."""
    settings = Settings(
        redis_url="redis://127.0.0.1:1/0",  # never dialled: the sentinels name the primary
        redis_password=ha.secrets.redis_password,
        **{name.removeprefix("TANDEM_").lower(): value for name, value in ha.service_env().items()},
    )
    config = RuntimeConfig.from_settings("relay", settings, uses_redis=True)
    assert config.redis_url is not None and config.redis_sentinel is not None
    client = short_command_client(config.redis_url, 64, redis_login("", config.redis_password), config.redis_sentinel)
    yield client
    await client.aclose()


def token(reply_id: str, seq: int) -> TokenEvent:
    event = TokenEvent(reply_id=reply_id, seq=seq, token_id=seq, text=f"t{seq} ")
    if seq == NUM_TOKENS:
        event.finish = FINISH_REASON_STOP
    return event


async def test_an_append_no_replica_took_in_time_is_not_acknowledged(ha, redis):
    writer = TokenLogWriter(redis, 600)
    reply_id = uuid.uuid4().hex
    await on_replicas(redis, WAIT, lambda client: writer.append(token(reply_id, 1), on=client))
    replicas = [ha.children[node.name] for node in ha.nodes[1:]]
    for child in replicas:  # frozen for well under the sentinels' down-after
        child.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(NotReplicated) as short:
            await on_replicas(redis, WAIT, lambda client: writer.append(token(reply_id, 2), on=client))
    finally:
        for child in replicas:
            child.process.send_signal(signal.SIGCONT)
    assert (await load_reply(redis, reply_id)).last_seq == 2  # on the primary, yet not vouched for
    assert short.value.written.num_appended == 1  # what the append did, for the relay to act on


async def test_killing_the_primary_mid_stream_loses_no_acknowledged_event_and_duplicates_none(ha, redis, nc):
    js = await ensure_token_stream(nc)
    writer = TokenLogWriter(redis, 600)
    acknowledged: list[tuple[str, int]] = []
    handled_at_s: list[float] = []

    async def log_events(events: list[TokenEvent]) -> None:  # the relay's: acknowledged when this returns
        await on_replicas(redis, WAIT, lambda client: writer.append_many(events, on=client))
        acknowledged.extend((event.reply_id, event.seq) for event in events)
        handled_at_s.append(time.monotonic())

    consumer = TokenConsumer(nc, log_events, TokenConsumerConfig(durable=f"failover-{uuid.uuid4().hex[:6]}", nak_delay_s=0.1))
    consuming = asyncio.create_task(consumer.run())
    buckets = TokenBuckets(redis, QuotaConfig(6000, 60000, 600000, refill_s=1e9, reservation_ttl_s=600))
    quota_user = f"u-{uuid.uuid4().hex[:6]}"
    await buckets.reserve(quota_user, Tier.FREE, 1000.0, uuid.uuid4().hex, num_prompt_tokens=10)
    reply_ids = [uuid.uuid4().hex for _ in range(NUM_REPLIES)]
    tail = LogTail(TailConfig("redis://127.0.0.1:1/0", num_readers=1, block_ms=500, unavailable_deadline_s=60), redis)
    followed = Collect()
    old_primary = ha.primary()
    assert old_primary is not None
    try:
        for seq in range(1, NUM_TOKENS + 1):
            await asyncio.gather(*(publish_token(js, token(r, seq)) for r in reply_ids))
            if seq == 1:  # followed once its log exists (a log unknown when followed ends at once)
                await wait_until(lambda: _has_log(redis, reply_ids[0]), timeout_s=20)
                await tail.follow(reply_ids[0], followed)
            if seq == NUM_TOKENS // 3:  # mid-stream, with events logged and more in flight
                await wait_until(lambda: _true(len(acknowledged) >= NUM_REPLIES * 10), timeout_s=20)
                num_acked_at_kill = len(acknowledged)
                ha.children[old_primary.name].process.kill()
            await asyncio.sleep(STEP_S)
        for reply_id in reply_ids:
            await wait_until(lambda reply_id=reply_id: _is_closed(redis, reply_id), timeout_s=60)
        assert await asyncio.wait_for(followed.ended, 30) is None
    finally:
        consuming.cancel()
        await tail.close()
    new_primary = ha.primary()
    assert new_primary not in (None, old_primary)
    assert num_acked_at_kill < NUM_REPLIES * NUM_TOKENS // 2, "the primary died after everything was logged"
    for reply_id in reply_ids:  # read from the new primary
        assert [e.seq for e in await logged_events(redis, reply_id)] == list(range(1, NUM_TOKENS + 1))
    assert set(acknowledged) == {(r, seq) for r in reply_ids for seq in range(1, NUM_TOKENS + 1)}
    assert followed.seqs == list(range(1, NUM_TOKENS + 1))
    assert (await buckets.peek(quota_user, Tier.FREE)).remaining_units == pytest.approx(5000, abs=0.5)
    longest_pause_s = max(later - earlier for earlier, later in zip(handled_at_s, handled_at_s[1:], strict=False))
    print(f"longest pause between logged events: {longest_pause_s:.2f} s (down-after {TIMING.down_after_ms} ms)")
    assert longest_pause_s < 15


async def test_the_killed_primary_comes_back_as_a_replica_of_the_new_one(ha, redis):
    # Runs after the failover above: launched again (as its supervisor would), it follows the new primary.
    dead = next(node for node in ha.nodes if ha.children[node.name].poll() is not None)
    await asyncio.to_thread(ha.launch, dead.name)
    client = aioredis.Redis(host="127.0.0.1", port=dead.port, password=ha.secrets.redis_password, decode_responses=True)
    try:
        info = await client.info("replication")
        primary = ha.primary()
        assert primary is not None and (info["role"], int(info["master_port"])) == ("slave", primary.port)
    finally:
        await client.aclose()


async def _true(value: bool) -> bool:
    return value


async def _has_log(redis: aioredis.Redis, reply_id: str) -> bool:
    return await load_reply(redis, reply_id) is not None


async def _is_closed(redis: aioredis.Redis, reply_id: str) -> bool:
    meta = await load_reply(redis, reply_id)
    return meta is not None and meta.last_seq == NUM_TOKENS
