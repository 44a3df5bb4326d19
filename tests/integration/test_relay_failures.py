"""The relay when things fail, on real NATS (JetStream) and a real redis-server that keeps its
data across a restart, with a real relay process: an old owner's events are dropped; a reply whose
worker stops heartbeating and producing is resubmitted to the router as a continuation; after the
last continuation it ends with an error and is stored as failed; a relay killed with -9, or a
Redis restarted, mid-stream loses no event; and every key left in Redis expires.

The module has its own servers: its relay consumes every token event and answers for every
running reply, so it must not share a bus or a Redis with other tests. A test "worker" here is a
publisher of WorkerHeartbeats and token events; a test "router" answers on tandem.v1.generate."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from helpers import next_heartbeat, ops_url, service_env, service_process, wait_until
from nats.aio.client import Client
from tokenlog.durable_redis import DurableRedis

from tandem.bus import decode, encode, subjects
from tandem.bus.events import ReplyStatus, now_ms
from tandem.bus.token_stream import ensure_token_stream, publish_token
from tandem.config import Tier
from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.servers import init_token_stream, start_nats
from tandem.quota import QuotaConfig, TokenBuckets, reservation_key, worst_case_units
from tandem.store import Conversation, NewMessage, Role
from tandem.store.sqlite import SqliteStore
from tandem.tokenlog import (
    RUNNING,
    UNPERSISTED,
    ReplyMeta,
    TokenLogWriter,
    begin_continuation,
    create_reply,
    load_reply,
    logged_events,
    read,
)
from tandem.v1.common_pb2 import FINISH_REASON_ERROR, FINISH_REASON_STOP, SamplingParams, Usage
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest, Refusal
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat

# Short, yet several heartbeats long, so a busy test machine does not make a claimed reply look lost.
STALL_TIMEOUT_S = 1.0
DISPATCH_GRACE_S = 2.0
MAX_CONTINUATIONS = 2
HEARTBEAT_S = 0.1


class Relay:
    """One relay process that a test may kill -9 and start again (same instance, same settings)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.instance_id = env["TANDEM_INSTANCE_ID"]
        self.child: ChildProcess | None = None

    def start(self) -> None:
        self.child = service_process("relay", self.env)
        self.child.start()

    def kill(self) -> None:
        assert self.child is not None
        self.child.process.kill()
        self.child.wait()

    def stop(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.stop(timeout_s=10)

    async def wait_ready(self, nc: Client) -> None:
        try:
            await next_heartbeat(nc, "relay", self.instance_id, accept=lambda hb: hb.is_ready, timeout_s=60)
        except TimeoutError:
            output = self.child.recent_output(40) if self.child else ""
            raise AssertionError(f"the relay never became ready:\n{output}") from None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("relay-failures")


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
        TANDEM_STALL_TIMEOUT_S=str(STALL_TIMEOUT_S),
        TANDEM_DISPATCH_GRACE_S=str(DISPATCH_GRACE_S),
        TANDEM_MAX_CONTINUATIONS=str(MAX_CONTINUATIONS),
    )
    process = Relay(env)
    process.start()
    yield process
    process.stop()
    if process.child is not None:
        print(process.child.recent_output(200))  # shown when a test of the module failed


@pytest_asyncio.fixture
async def nc(nats_url) -> AsyncIterator[Client]:
    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest_asyncio.fixture
async def js(nc):
    return await ensure_token_stream(nc)


@pytest_asyncio.fixture
async def ready(relay, nc) -> Relay:
    if relay.child is None or relay.child.poll() is not None:
        relay.start()
    await relay.wait_ready(nc)
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


class Worker:
    """A stand-in worker: claims replies in heartbeats on real NATS while it is alive."""

    def __init__(self, nc: Client, reply_ids: list[str]) -> None:
        self._nc = nc
        self.reply_ids = reply_ids
        self.instance_id = f"decode-fake-{uuid.uuid4().hex[:6]}"
        self.num_heartbeats = 0
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        subject = subjects.heartbeat("decode", self.instance_id)

        async def pong(msg) -> None:
            await msg.respond(b"")

        # Answers pings while alive, as every service does; a dead one leaves "no responders".
        pings = await self._nc.subscribe(subjects.ping(self.instance_id), cb=pong)
        try:
            await self._beat_forever(subject)
        finally:
            await pings.unsubscribe()

    async def _beat_forever(self, subject: str) -> None:
        while True:
            service = ServiceHeartbeat(
                role="decode", instance_id=self.instance_id, is_ready=True, sent_unix_ms=now_ms(), interval_s=HEARTBEAT_S
            )
            await self._nc.publish(subject, encode(WorkerHeartbeat(service=service, reply_ids=self.reply_ids)))
            self.num_heartbeats += 1
            await asyncio.sleep(HEARTBEAT_S)

    async def claim(self, reply_id: str) -> None:
        """Claims `reply_id` from its next heartbeat on, as a worker does once it accepts a reply."""
        self.reply_ids.append(reply_id)

    def __enter__(self) -> Worker:
        self._task = asyncio.create_task(self._beat())
        return self

    def __exit__(self, *exc: object) -> None:
        self.die()

    def die(self) -> None:
        if self._task is not None:
            self._task.cancel()


class Router:
    """Answers GenerateRequests on tandem.v1.generate as the router would: accepts, or refuses."""

    def __init__(self, nc: Client, refuse: bool = False, assign_to: Worker | None = None) -> None:
        self._nc = nc
        self._refuse = refuse
        self._assign_to = assign_to
        self.requests: asyncio.Queue[GenerateRequest] = asyncio.Queue()
        self._subscription = None

    async def __aenter__(self) -> Router:
        async def on_request(msg) -> None:
            request = decode(msg.data, GenerateRequest)
            self.requests.put_nowait(request)
            if self._refuse:
                answer = GenerateReply(refused=Refusal(reason="overloaded", message="busy"))
            else:
                if self._assign_to is not None:
                    await self._assign_to.claim(request.reply_id)
                answer = GenerateReply(reply_id=request.reply_id, model="m")
            await msg.respond(encode(answer))

        self._subscription = await self._nc.subscribe(subjects.GENERATE, cb=on_request)
        await self._nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._subscription.unsubscribe()

    async def next_request(self, timeout_s: float = 20) -> GenerateRequest:
        return await asyncio.wait_for(self.requests.get(), timeout_s)


def token(reply_id: str, seq: int, *, epoch: int = 0, text: str | None = None, final: bool = False) -> TokenEvent:
    event = TokenEvent(reply_id=reply_id, seq=seq, token_id=100 + seq, text=f"t{seq} " if text is None else text, epoch=epoch)
    if final:
        event.finish = FINISH_REASON_STOP
        event.usage.CopyFrom(Usage(input_tokens=3, output_tokens=seq))
    return event


def original_request(reply_id: str) -> GenerateRequest:
    return GenerateRequest(
        request_id=reply_id,
        reply_id=reply_id,
        model="m",
        user_id="u1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(temperature=0.0, max_tokens=50),
    )


async def new_turn(store: SqliteStore, redis, *, with_request: bool = True) -> str:
    """A running assistant turn in the store and its reply recorded in the log, as chat does."""
    now = now_ms()
    conversation = await store.create_conversation(Conversation(uuid.uuid4().hex, "u1", "t", "m", now, now))
    reply_id = uuid.uuid4().hex
    await store.append_message(
        "u1",
        NewMessage(id=reply_id, conversation_id=conversation.id, role=Role.ASSISTANT, content="", tokens=0, status=ReplyStatus.RUNNING),
    )
    request = original_request(reply_id).SerializeToString() if with_request else b""
    meta = ReplyMeta(reply_id=reply_id, user_id="u1", conversation_id=conversation.id, message_id=reply_id, model="m", request=request)
    await create_reply(redis, meta, track_readers=False)
    return reply_id


async def num_logged(redis, reply_id: str) -> int:
    meta = await load_reply(redis, reply_id)
    return 0 if meta is None else meta.last_seq


async def stored(store: SqliteStore, reply_id: str):
    async def finished():
        message = await store.get_message(reply_id)
        return message if message.status != ReplyStatus.RUNNING else None

    return await wait_until(finished, timeout_s=30)


async def test_an_event_of_an_old_owner_is_dropped_after_a_continuation(ready, nc, js, redis, store):
    reply_id = await new_turn(store, redis)
    with Worker(nc, [reply_id]):  # claimed throughout: the relay leaves it alone
        for seq in (1, 2):
            await publish_token(js, token(reply_id, seq))
        await wait_until(lambda: _equals(num_logged(redis, reply_id), 2), timeout_s=20)
        continuation = await begin_continuation(redis, reply_id)
        assert continuation == (1, [101, 102])
        await publish_token(js, token(reply_id, 3, text="stale "))  # epoch 0: the old owner
        await publish_token(js, token(reply_id, 3, epoch=1, text="new ", final=True))
        message = await stored(store, reply_id)
    assert (message.status, message.content) == (ReplyStatus.COMPLETE, "t1 t2 new ")
    assert [(e.seq, e.epoch) for e in await logged_events(redis, reply_id)] == [(1, 0), (2, 0), (3, 1)]


async def _equals(value, expected) -> bool:
    return (await value) == expected


async def test_a_reply_whose_worker_is_lost_is_continued_through_the_router(ready, nc, js, redis, store):
    reply_id = await new_turn(store, redis)
    num_stalls_before = await _relay_metric(ready, "tandem_relay_stalls_total")
    with Worker(nc, []) as new_owner:
        async with Router(nc, assign_to=new_owner) as router:
            with Worker(nc, [reply_id]) as worker:
                for seq in (1, 2, 3):
                    await publish_token(js, token(reply_id, seq))
                await wait_until(lambda: _equals(num_logged(redis, reply_id), 3), timeout_s=20)
                # Silent but claimed for well past the stall timeout: not stalled.
                enough = worker.num_heartbeats + int(3 * STALL_TIMEOUT_S / HEARTBEAT_S)
                await wait_until(lambda: _at_least(worker.num_heartbeats, enough), timeout_s=20)
                assert router.requests.empty()
            # The worker is gone: its claims stop, and nothing more is logged.
            request = await router.next_request()
        expected = original_request(reply_id)
        expected.resume_reply_id = reply_id
        expected.generated_token_ids.extend([101, 102, 103])
        expected.epoch = 1
        assert request == expected
        meta = await load_reply(redis, reply_id)
        assert (meta.epoch, meta.num_continuations, meta.is_running) == (1, 1, True)
        await publish_token(js, token(reply_id, 4, text="zombie "))  # the lost worker, late
        for seq in (4, 5):
            await publish_token(js, token(reply_id, seq, epoch=1, text=f"n{seq} ", final=seq == 5))
        message = await stored(store, reply_id)
    assert (message.status, message.content) == (ReplyStatus.COMPLETE, "t1 t2 t3 n4 n5 ")
    # Found by its ping ("no responders" once it stopped answering), not only by its silence.
    assert await _relay_metric(ready, "tandem_relay_workers_gone_total") >= 1
    assert await _relay_metric(ready, "tandem_relay_stalls_total") > num_stalls_before
    # The first continuation the module's relay resubmits (it is exported once one is counted).
    assert await _relay_metric(ready, 'tandem_relay_continuations_total{outcome="accepted"}') >= 1


async def _relay_metric(relay: Relay, name: str) -> float:
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"{ops_url(relay.env)}/metrics")).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} is not exported"
    return values[0]


async def _at_least(value: int, minimum: int) -> bool:
    return value >= minimum


async def test_a_reply_lost_after_its_last_continuation_ends_with_an_error_and_is_stored_failed(ready, nc, js, redis, store):
    reply_id = await new_turn(store, redis)
    buckets = TokenBuckets(redis, QuotaConfig(6000, 60000, 600000, refill_s=1e9, reservation_ttl_s=600))
    quota_user = uuid.uuid4().hex
    await buckets.reserve(quota_user, Tier.FREE, worst_case_units(3, 48), reply_id, num_prompt_tokens=3)
    reader = asyncio.create_task(_read_all(redis, reply_id))
    # A live worker that claims something else: the relay hears the fleet, and nobody claims this reply.
    with Worker(nc, []):
        async with Router(nc, refuse=True) as router:
            for seq in (1, 2):
                await publish_token(js, token(reply_id, seq))  # no worker claims it: it stalls once these are logged
            requests = [await router.next_request() for _ in range(MAX_CONTINUATIONS)]
            message = await stored(store, reply_id)
            assert router.requests.empty()
    assert [(r.epoch, list(r.generated_token_ids)) for r in requests] == [(1, [101, 102]), (2, [101, 102])]
    assert (message.status, message.content) == (ReplyStatus.FAILED, "t1 t2 ")
    events = await asyncio.wait_for(reader, 10)  # what a client streaming it sees
    last = events[-1]
    assert (last.seq, last.finish, last.error.code, last.epoch) == (3, FINISH_REASON_ERROR, "worker_lost", MAX_CONTINUATIONS + 1)
    assert "regenerate" in last.error.message
    assert not await redis.sismember(RUNNING, reply_id)
    # The relay ended it: it settles it too, charging the prompt and the 2 tokens delivered (3 + 2 x4).
    await wait_until(lambda: _equals(redis.exists(reservation_key(reply_id)), 0))
    assert (await buckets.peek(quota_user, Tier.FREE)).remaining_units == pytest.approx(6000 - 11, abs=0.5)


async def _read_all(redis, reply_id: str) -> list[TokenEvent]:
    return [event async for event in read(redis, reply_id, block_ms=500)]


async def test_a_relay_killed_with_events_unacknowledged_loses_none_once_a_relay_starts_again(ready, nc, js, redis, store):
    reply_ids = [await new_turn(store, redis) for _ in range(8)]
    num_tokens = 120
    with Worker(nc, reply_ids):
        for seq in range(1, num_tokens // 2 + 1):
            await asyncio.gather(*(publish_token(js, token(r, seq)) for r in reply_ids))
        await wait_until(lambda: _any_logged(redis, reply_ids), timeout_s=20)
        ready.kill()
        num_logged_at_kill = sum([await num_logged(redis, r) for r in reply_ids])
        for seq in range(num_tokens // 2 + 1, num_tokens + 1):
            await asyncio.gather(*(publish_token(js, token(r, seq, final=seq == num_tokens)) for r in reply_ids))
        ready.start()
        await ready.wait_ready(nc)
        messages = [await stored(store, r) for r in reply_ids]
    assert num_logged_at_kill < len(reply_ids) * num_tokens // 2, "the relay was killed after it had logged everything"
    expected = "".join(f"t{seq} " for seq in range(1, num_tokens + 1))
    assert [(m.status, m.content) for m in messages] == [(ReplyStatus.COMPLETE, expected)] * len(reply_ids)
    for reply_id in reply_ids:
        assert [e.seq for e in await logged_events(redis, reply_id)] == list(range(1, num_tokens + 1))


async def _any_logged(redis, reply_ids: list[str]) -> bool:
    return any([await num_logged(redis, r) for r in reply_ids])


async def test_a_redis_restart_mid_stream_loses_no_event(ready, nc, js, redis, redis_server, store):
    reply_ids = [await new_turn(store, redis) for _ in range(4)]
    num_tokens = 40
    readers = [asyncio.create_task(_read_all(redis, r)) for r in reply_ids]
    with Worker(nc, reply_ids):
        for seq in range(1, num_tokens // 2 + 1):
            await asyncio.gather(*(publish_token(js, token(r, seq)) for r in reply_ids))
        for reply_id in reply_ids:
            await wait_until(lambda reply_id=reply_id: _equals(num_logged(redis, reply_id), num_tokens // 2), timeout_s=20)
        redis_server.stop()
        for seq in range(num_tokens // 2 + 1, num_tokens + 1):  # while Redis is down
            await asyncio.gather(*(publish_token(js, token(r, seq, final=seq == num_tokens)) for r in reply_ids))
        redis_server.start()
        messages = [await stored(store, r) for r in reply_ids]
        streamed = await asyncio.wait_for(asyncio.gather(*readers), 30)
    expected = "".join(f"t{seq} " for seq in range(1, num_tokens + 1))
    assert [(m.status, m.content) for m in messages] == [(ReplyStatus.COMPLETE, expected)] * len(reply_ids)
    assert [[e.seq for e in events] for events in streamed] == [list(range(1, num_tokens + 1))] * len(reply_ids)


async def test_a_reply_closed_by_a_relay_that_died_before_storing_it_is_stored_by_a_sweep(ready, redis, store):
    reply_id = await new_turn(store, redis)
    writer = TokenLogWriter(redis, 600)  # the dead relay's appends: no relay here sees these events
    for seq in (1, 2, 3):
        await writer.append(token(reply_id, seq, final=seq == 3))
    assert await redis.sismember(UNPERSISTED, reply_id)
    message = await stored(store, reply_id)
    assert (message.status, message.content) == (ReplyStatus.COMPLETE, "t1 t2 t3 ")
    await wait_until(lambda: _equals(redis.sismember(UNPERSISTED, reply_id), 0))


async def test_every_key_the_replies_left_in_redis_expires(ready, redis):
    # Runs last in this module: the replies above (continued, failed, redelivered, restarted) are all here.
    keys = [key async for key in redis.scan_iter(count=1000)]
    assert len(keys) > 20
    no_expiry = [key for key in keys if await redis.ttl(key) == -1]
    assert no_expiry == []
