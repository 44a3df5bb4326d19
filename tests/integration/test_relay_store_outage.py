"""A store outage longer than every expiry of the token log loses no finished reply: on real NATS
(JetStream), a real redis-server, a real SQLite file and a real relay process whose expiries are
compressed to seconds (a closed log 1 s, a waiting one 3 s), the store is held down (another
process holds SQLite's write lock, so every write the relay tries fails as the store being
unavailable) while replies finish one after another, each outliving the log expiry of the one
before; one of them cannot be saved at all (its request in the log is not a GenerateRequest).
Meanwhile every reply stays waiting with its log, and the relay exports how many wait and for how
long. Once the store is back every turn is stored complete with its whole text, the unsaveable
reply is still kept and retried without holding up the others, and every key has an expiry.

A full Redis (its maxmemory reached, policy noeviction) refuses the relay's appends: the relay
hands each event back to the token stream and exports the reading, and once memory is freed
every event is logged in order and the turn stored whole; a policy that may evict is reported.

Before unstored.py (each sweep stopped at its first failure and pushed back the expiry of that
one reply), the other replies' logs expired during the outage and their turns were lost.

The module has its own servers: its relay consumes every token event, so it must not share a bus
or a Redis with other tests."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from helpers import next_heartbeat, ops_url, service_env, service_process, wait_until
from nats.aio.client import Client
from tokenlog.durable_redis import DurableRedis

from services.relay.unstored import UnstoredConfig, keep_unstored
from tandem.bus.events import ReplyStatus, now_ms
from tandem.bus.token_stream import ensure_token_stream, publish_token
from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.servers import init_token_stream, start_nats
from tandem.store import Conversation, NewMessage, Role
from tandem.store.sqlite import SqliteStore
from tandem.tokenlog import UNPERSISTED, ReplyKeys, ReplyMeta, create_reply, load_reply
from tandem.v1.common_pb2 import FINISH_REASON_STOP, SamplingParams, Usage
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent

LOG_TTL_S = 1  # a closed log's expiry
KEEP_S = 3  # a running reply's expiry, which a waiting one's log is kept for from each sweep
OUTLIVE_S = KEEP_S + 1.5  # how long the outage goes on after each reply finishes
NUM_TOKENS = 12


@dataclass(frozen=True)
class Relay:
    child: ChildProcess
    env: dict[str, str]

    @property
    def metrics_url(self) -> str:
        return f"{ops_url(self.env)}/metrics"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("relay-store-outage")


@pytest.fixture(scope="module")
def nats_url(workdir) -> Iterator[str]:
    server = start_nats(workdir)
    init_token_stream(server)  # the admin step: the relay only waits for the stream
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def redis_server(workdir) -> Iterator[DurableRedis]:
    server = DurableRedis(workdir, free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def relay(workdir, nats_url, redis_server) -> Iterator[Relay]:
    env = service_env(
        "relay",
        nats_url,
        redis_server.url,
        TANDEM_SQLITE_PATH=str(workdir / "conversations.db"),
        TANDEM_STORE_TIMEOUT_S="0.2",
        TANDEM_TOKEN_LOG_TTL_S=str(LOG_TTL_S),
        TANDEM_RUNNING_REPLY_TTL_S=str(KEEP_S),
        TANDEM_REDIS_MEMORY_CHECK_S="0.2",
    )
    child = service_process("relay", env)
    child.start()
    yield Relay(child, env)
    child.stop(timeout_s=10)
    print(child.recent_output(200))  # shown when a test of the module failed


@pytest_asyncio.fixture
async def nc(nats_url) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest_asyncio.fixture
async def ready(relay, nc) -> Relay:
    instance_id = relay.env["TANDEM_INSTANCE_ID"]
    try:
        await next_heartbeat(nc, "relay", instance_id, accept=lambda hb: hb.is_ready, timeout_s=60)
    except TimeoutError:
        raise AssertionError(f"the relay never became ready:\n{relay.child.recent_output(40)}") from None
    return relay


@pytest_asyncio.fixture
async def redis(redis_server) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url, socket_timeout=10)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def store(workdir) -> AsyncIterator[SqliteStore]:
    store = SqliteStore(workdir / "conversations.db")
    await store.start()
    yield store
    await store.close()


class StoreOutage:
    """Another process holds the SQLite file's write lock: every write the relay tries waits out
    its store timeout and fails as the store being unavailable; reads still answer."""

    def __init__(self, path: Path) -> None:
        script = f"""
            import sqlite3, sys
            db = sqlite3.connect({str(path)!r}, isolation_level=None)
            db.execute("BEGIN IMMEDIATE")
            print("locked", flush=True)
            sys.stdin.readline()
            db.execute("COMMIT")
        """
        self._holder = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def __enter__(self) -> StoreOutage:
        assert self._holder.stdout is not None
        assert self._holder.stdout.readline().strip() == "locked"
        return self

    def end(self) -> None:
        if self._holder.poll() is None:
            assert self._holder.stdin is not None
            self._holder.stdin.write("over\n")
            self._holder.stdin.flush()
            assert self._holder.wait(timeout=10) == 0

    def __exit__(self, *exc: object) -> None:
        self._holder.kill()
        self._holder.wait(timeout=10)


def text_of(seq: int) -> str:
    return f"w{seq} "


def token(reply_id: str, seq: int) -> TokenEvent:
    event = TokenEvent(reply_id=reply_id, seq=seq, token_id=100 + seq, text=text_of(seq))
    if seq == NUM_TOKENS:
        event.finish = FINISH_REASON_STOP
        event.usage.CopyFrom(Usage(input_tokens=3, output_tokens=seq))
    return event


async def new_turn(store: SqliteStore, redis, *, reply_id: str | None = None, request: bytes | None = None) -> str:
    """A running assistant turn in the store and its reply recorded in the log, as chat does."""
    now = now_ms()
    conversation = await store.create_conversation(Conversation(uuid.uuid4().hex, "u1", "t", "m", now, now))
    reply_id = reply_id or uuid.uuid4().hex
    await store.append_message(
        "u1",
        NewMessage(id=reply_id, conversation_id=conversation.id, role=Role.ASSISTANT, content="", tokens=0, status=ReplyStatus.RUNNING),
    )
    if request is None:
        sampling = SamplingParams(temperature=0.0, max_tokens=50)
        request = GenerateRequest(request_id=reply_id, reply_id=reply_id, model="m", user_id="u1", sampling=sampling).SerializeToString()
    meta = ReplyMeta(reply_id=reply_id, user_id="u1", conversation_id=conversation.id, message_id=reply_id, model="m", request=request)
    await create_reply(redis, meta, track_readers=False)
    return reply_id


async def relay_metric(relay: Relay, name: str) -> float:
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(relay.metrics_url)).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} is not exported"
    return values[0]


async def the_outage_goes_on(duration_s: float) -> None:
    """The outage itself: a length of time under test, not a wait for some condition."""
    await asyncio.sleep(duration_s)


async def test_no_finished_reply_is_lost_in_a_store_outage_longer_than_the_log_expiry(ready, nc, redis, store, workdir):
    js = await ensure_token_stream(nc)
    replies = [await new_turn(store, redis) for _ in range(4)]
    # Sorted first among the waiting replies, so every sweep meets its failure before the others.
    unsaveable = await new_turn(store, redis, reply_id=f"000{uuid.uuid4().hex}", request=b"\xff\xff not a request")
    outage_began = asyncio.get_running_loop().time()
    with StoreOutage(workdir / "conversations.db") as outage:
        for reply_id in [unsaveable, *replies]:
            for seq in range(1, NUM_TOKENS + 1):
                await publish_token(js, token(reply_id, seq))
            await wait_until(lambda reply_id=reply_id: redis.sismember(UNPERSISTED, reply_id), timeout_s=20)  # its log closed
            await the_outage_goes_on(OUTLIVE_S)
        outage_s = asyncio.get_running_loop().time() - outage_began
        assert outage_s > 5 * KEEP_S
        lost = [reply_id for reply_id in [unsaveable, *replies] if not await _is_waiting_with_its_log(redis, reply_id)]
        assert lost == [], f"{len(lost)} of {len(replies) + 1} replies lost their logs while they waited for the store"
        assert [(await store.get_message(r)).status for r in replies] == [ReplyStatus.RUNNING] * len(replies)  # nothing stored yet
        assert await relay_metric(ready, "tandem_relay_replies_waiting_for_store") == len(replies) + 1
        assert await relay_metric(ready, "tandem_relay_oldest_wait_for_store_seconds") > 4 * KEEP_S
        outage.end()
    for reply_id in replies:
        await wait_until(lambda reply_id=reply_id: _is_finished(store, reply_id), timeout_s=30)
    whole_text = "".join(text_of(seq) for seq in range(1, NUM_TOKENS + 1))
    stored = [await store.get_message(r) for r in replies]
    assert [(m.status, m.content, m.tokens) for m in stored] == [(ReplyStatus.COMPLETE, whole_text, NUM_TOKENS)] * len(replies)
    await wait_until(lambda: _waiting_are(ready, 1), timeout_s=20)
    # The unsaveable reply is still kept and retried; its turn is not guessed at.
    assert await redis.sismember(UNPERSISTED, unsaveable)
    assert await redis.ttl(ReplyKeys(unsaveable).log) > 0
    assert (await store.get_message(unsaveable)).status == ReplyStatus.RUNNING
    no_expiry = [key async for key in redis.scan_iter(count=1000) if await redis.ttl(key) == -1]
    assert no_expiry == []


async def _is_waiting_with_its_log(redis, reply_id: str) -> bool:
    meta = await load_reply(redis, reply_id)
    return bool(await redis.sismember(UNPERSISTED, reply_id)) and meta is not None and meta.last_seq == NUM_TOKENS


async def _is_finished(store: SqliteStore, reply_id: str) -> bool:
    return (await store.get_message(reply_id)).status != ReplyStatus.RUNNING


async def _waiting_are(relay: Relay, expected: int) -> bool:
    return await relay_metric(relay, "tandem_relay_replies_waiting_for_store") == expected


async def test_a_full_redis_refuses_events_and_loses_none(ready, nc, redis, store):
    js = await ensure_token_stream(nc)
    reply_id = await new_turn(store, redis)
    half = NUM_TOKENS // 2
    for seq in range(1, half + 1):
        await publish_token(js, token(reply_id, seq))
    await wait_until(lambda: _has_logged(redis, reply_id, half), timeout_s=20)
    retried_before = await relay_metric(ready, "tandem_relay_events_retried_total")
    await redis.config_set("maxmemory", 1)  # every write refused: OOM, with noeviction
    try:
        for seq in range(half + 1, NUM_TOKENS + 1):
            await publish_token(js, token(reply_id, seq))
        await wait_until(lambda: _metric_is(ready, "tandem_relay_redis_maxmemory_bytes", 1), timeout_s=20)
        assert await relay_metric(ready, "tandem_relay_redis_used_memory_bytes") > 1
        await wait_until(lambda: _metric_above(ready, "tandem_relay_events_retried_total", retried_before), timeout_s=20)
        assert (await load_reply(redis, reply_id)).last_seq == half  # refused, not logged
    finally:
        await redis.config_set("maxmemory", 0)
    await wait_until(lambda: _is_finished(store, reply_id), timeout_s=30)
    stored = await store.get_message(reply_id)
    whole_text = "".join(text_of(seq) for seq in range(1, NUM_TOKENS + 1))
    assert (stored.status, stored.content, stored.tokens) == (ReplyStatus.COMPLETE, whole_text, NUM_TOKENS)
    assert await relay_metric(ready, "tandem_relay_redis_may_evict") == 0
    await redis.config_set("maxmemory-policy", "allkeys-lru")
    try:
        await wait_until(lambda: _metric_is(ready, "tandem_relay_redis_may_evict", 1), timeout_s=20)
    finally:
        await redis.config_set("maxmemory-policy", "noeviction")
    await wait_until(lambda: _metric_is(ready, "tandem_relay_redis_may_evict", 0), timeout_s=20)


async def _has_logged(redis, reply_id: str, seq: int) -> bool:
    meta = await load_reply(redis, reply_id)
    return meta is not None and meta.last_seq >= seq


async def _metric_is(relay: Relay, name: str, value: float) -> bool:
    return await relay_metric(relay, name) == value


async def _metric_above(relay: Relay, name: str, value: float) -> bool:
    return await relay_metric(relay, name) > value


async def test_a_reply_waiting_past_the_bound_is_given_up_and_its_log_left_to_expire(redis_server):
    # Database 1 of the module's Redis: the relay, on database 0, neither sees nor stores this reply.
    client = aioredis.from_url(redis_server.url.removesuffix("/0") + "/1", socket_timeout=10)
    try:
        config = UnstoredConfig(keep_s=3600, max_wait_s=60, ttl_s=30)
        old, recent = ReplyKeys("finished-long-ago"), ReplyKeys("finished-just-now")
        for keys, finished_ms in ((old, now_ms() - 120_000), (recent, now_ms() - 10_000)):
            await client.hset(keys.meta, mapping={"status": "complete", "finished_ms": finished_ms})
            await client.xadd(keys.log, {"e": b""}, id="1-1")
            for key in (keys.meta, keys.log):
                await client.expire(key, 5)
            await client.sadd(UNPERSISTED, keys.reply_id)
        await client.sadd(UNPERSISTED, "gone")  # its keys expired: left for the sweep to drop
        waiting = await keep_unstored(client, config)
        assert waiting.given_up == ("finished-long-ago",)
        assert (waiting.num_replies, round(waiting.oldest_wait_s)) == (2, 10)
        assert {m.decode() for m in await client.smembers(UNPERSISTED)} == {"finished-just-now", "gone"}
        assert 5 < await client.ttl(recent.log) <= 3600 and 5 < await client.ttl(recent.meta) <= 3600  # kept
        assert 0 < await client.ttl(old.log) <= 30 and 0 < await client.ttl(old.meta) <= 30  # left to expire
        assert await client.exists(ReplyKeys("gone").log, ReplyKeys("gone").meta) == 0  # no key made for it
        assert 0 < await client.ttl(UNPERSISTED) <= 86400
    finally:
        await client.flushdb()
        await client.aclose()
