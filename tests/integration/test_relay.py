"""Two relay processes on real NATS (their shared JetStream consumer) and Redis: events delivered
shuffled and twice are logged once and in order, a finished reply is stored as its assistant turn
with nobody connected and counted once in the usage ledger, a shadow reply's answer is stored
beside the reply it mirrors (no turn, no usage), every finished reply's outcome is published for
the routers, and a reply nobody reads is cancelled if it was created to track its
readers. The module has its own nats-server and redis-server: the relays consume every reply's
tokens, so they must not share a bus with other tests. The events here are published on core
NATS, which the token stream captures as well."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import nats
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from helpers import next_heartbeat, service_env, service_process, wait_until

from tandem.bus import decode, encode, subjects
from tandem.bus.events import ReplyStatus, now_ms
from tandem.config import Tier
from tandem.devstack.proc import ChildProcess
from tandem.devstack.servers import init_token_stream, start_nats, start_redis
from tandem.quota import QuotaConfig, TokenBuckets, reservation_key, worst_case_units
from tandem.store import Conversation, NewMessage, Role
from tandem.store.sqlite import SqliteStore
from tandem.store.usage import today_utc
from tandem.tokenlog import UNPERSISTED, ReplyMeta, create_reply, load_reply, read
from tandem.v1.common_pb2 import FINISH_REASON_CANCELLED, FINISH_REASON_ERROR, FINISH_REASON_STOP, LANE_BACKGROUND, LANE_PAID, Error, Usage
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import Cancel, TokenEvent
from tandem.v1.worker_pb2 import ReplyOutcome

IDLE_TIMEOUT_S = 1.0
QUOTA = QuotaConfig(capacity_free=6000, capacity_plus=60000, capacity_pro=600000, refill_s=1e9, reservation_ttl_s=600)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("relay") / "conversations.db")


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[tuple[str, str]]:
    workdir = tmp_path_factory.mktemp("relay-servers")
    nats_server, redis_server = start_nats(workdir), start_redis(workdir)
    init_token_stream(nats_server)  # the admin step: services only wait for the stream
    yield nats_server.url, redis_server.url
    redis_server.stop()
    nats_server.stop()


@pytest.fixture(scope="module")
def relays(servers, store_path) -> Iterator[list[ChildProcess]]:
    nats_url, redis_url = servers
    children: list[ChildProcess] = []
    for _ in range(2):
        env = service_env(
            "relay",
            nats_url,
            redis_url,
            TANDEM_SQLITE_PATH=store_path,
            TANDEM_READER_IDLE_TIMEOUT_S=str(IDLE_TIMEOUT_S),
            TANDEM_STALL_TIMEOUT_S="60",  # no worker heartbeats here: replies must not be taken for lost
        )
        child = service_process("relay", env)
        child.name = env["TANDEM_INSTANCE_ID"]
        child.start()
        children.append(child)
    yield children
    for child in children:
        child.stop(timeout_s=10)


@pytest_asyncio.fixture
async def nc(servers):
    client = await nats.connect(servers[0])
    yield client
    await client.close()


@pytest_asyncio.fixture
async def ready(nc, relays):
    for child in relays:
        try:
            await next_heartbeat(nc, "relay", child.name, accept=lambda hb: hb.is_ready, timeout_s=60)
        except TimeoutError:
            raise AssertionError(f"{child.name} never became ready:\n{child.recent_output(40)}") from None


@pytest_asyncio.fixture
async def redis(servers):
    client = aioredis.from_url(servers[1], socket_timeout=10)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def store(store_path):
    store = SqliteStore(Path(store_path))
    await store.start()
    yield store
    await store.close()


def reply_events(reply_id: str, num: int, finish: int = FINISH_REASON_STOP) -> list[TokenEvent]:
    events = [TokenEvent(reply_id=reply_id, seq=i, token_id=i, text=f"t{i} ") for i in range(1, num + 1)]
    events[-1].finish = finish
    events[-1].usage.CopyFrom(Usage(input_tokens=9, output_tokens=num))
    return events


async def logged(redis, reply_id: str) -> list[TokenEvent]:
    return [event async for event in read(redis, reply_id, block_ms=5000)]


async def test_shuffled_and_repeated_deliveries_are_logged_once_in_order(ready, nc, redis):
    reply_id = uuid.uuid4().hex
    events = reply_events(reply_id, 40)
    deliveries = events + random.Random(3).sample(events, 15)
    random.Random(5).shuffle(deliveries)
    for event in deliveries:
        await nc.publish(subjects.tokens(reply_id), encode(event))
    log = await asyncio.wait_for(logged(redis, reply_id), 30)
    assert [e.seq for e in log] == list(range(1, 41))
    assert "".join(e.text for e in log) == "".join(e.text for e in events)


async def test_a_finished_reply_is_stored_as_its_assistant_turn_with_nobody_connected(ready, nc, redis, store):
    """...with the model its final event names (the one that wrote it), not the one it was asked of."""
    now = now_ms()
    conversation = await store.create_conversation(Conversation(uuid.uuid4().hex, "u1", "t", "m", now, now))
    reply_id = uuid.uuid4().hex
    await store.append_message(
        "u1",
        NewMessage(
            id=reply_id,
            conversation_id=conversation.id,
            role=Role.ASSISTANT,
            content="",
            tokens=0,
            model="small",
            status=ReplyStatus.RUNNING,
        ),
    )
    await create_reply(
        redis, ReplyMeta(reply_id=reply_id, user_id="u1", conversation_id=conversation.id, message_id=reply_id), track_readers=False
    )
    events = reply_events(reply_id, 6)
    events[-1].model = "large"
    for event in events:
        await nc.publish(subjects.tokens(reply_id), encode(event))

    async def stored():
        message = await store.get_message(reply_id)
        return message if message.status != ReplyStatus.RUNNING else None

    message = await wait_until(stored)
    assert (message.status, message.content, message.tokens, message.model) == (ReplyStatus.COMPLETE, "t1 t2 t3 t4 t5 t6 ", 6, "large")


async def test_a_reply_nobody_reads_is_cancelled_then_stored_as_stopped(ready, nc, redis, store):
    now = now_ms()
    conversation = await store.create_conversation(Conversation(uuid.uuid4().hex, "u2", "t", "m", now, now))
    reply_id = uuid.uuid4().hex
    await store.append_message(
        "u2",
        NewMessage(id=reply_id, conversation_id=conversation.id, role=Role.ASSISTANT, content="", tokens=0, status=ReplyStatus.RUNNING),
    )
    cancelled: asyncio.Future[Cancel] = asyncio.get_running_loop().create_future()

    async def on_cancel(msg):
        if not cancelled.done():
            cancelled.set_result(decode(msg.data, Cancel))

    subscription = await nc.subscribe(subjects.cancel(reply_id), cb=on_cancel)
    await create_reply(
        redis, ReplyMeta(reply_id=reply_id, user_id="u2", conversation_id=conversation.id, message_id=reply_id), track_readers=True
    )
    first = reply_events(reply_id, 3, finish=FINISH_REASON_CANCELLED)
    await nc.publish(subjects.tokens(reply_id), encode(first[0]))
    cancel = await asyncio.wait_for(cancelled, 15)
    await subscription.unsubscribe()
    assert cancel.reason == "no_reader"
    for event in first[1:]:  # what the worker sends once it sees the cancel
        await nc.publish(subjects.tokens(reply_id), encode(event))

    async def stored():
        message = await store.get_message(reply_id)
        return message if message.status != ReplyStatus.RUNNING else None

    message = await wait_until(stored)
    assert (message.status, message.content) == (ReplyStatus.STOPPED, "t1 t2 t3 ")
    assert (await load_reply(redis, reply_id)).status.value == "stopped"


async def test_only_a_reply_created_to_track_readers_is_cancelled_for_want_of_them(ready, nc, redis):
    # Ids in sweep order: the untracked reply is looked at first in every sweep, and was idle longer.
    untracked, tracked = "0" + uuid.uuid4().hex, "f" + uuid.uuid4().hex
    cancelled: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_cancel(msg):
        if not cancelled.done():
            cancelled.set_result(decode(msg.data, Cancel).reply_id)

    subscription = await nc.subscribe(subjects.CANCEL_ALL, cb=on_cancel)
    await create_reply(redis, ReplyMeta(reply_id=untracked), track_readers=False)
    await create_reply(redis, ReplyMeta(reply_id=tracked), track_readers=True)
    for reply_id in (untracked, tracked):
        await nc.publish(subjects.tokens(reply_id), encode(reply_events(reply_id, 3)[0]))
    assert await asyncio.wait_for(cancelled, 15) == tracked
    await subscription.unsubscribe()
    assert (await load_reply(redis, untracked)).cancel_sent_ms == 0
    assert (await load_reply(redis, tracked)).cancel_sent_ms > 0


async def test_a_finished_reply_is_settled_with_the_usage_of_its_logged_final_event(ready, nc, redis):
    buckets = TokenBuckets(redis, QUOTA)  # a refill too slow to matter here
    user, reply_id = uuid.uuid4().hex, uuid.uuid4().hex
    await create_reply(redis, ReplyMeta(reply_id=reply_id, user_id=user), track_readers=False)
    assert (await buckets.reserve(user, Tier.FREE, worst_case_units(9, 100), reply_id, num_prompt_tokens=9)).is_admitted
    events = reply_events(reply_id, 6)  # 9 in, 6 out: 33 units
    for event in [events[-1], *events[:-1]]:  # the final event first: held until the gap before it fills
        await nc.publish(subjects.tokens(reply_id), encode(event))
    await wait_until(lambda: _is_gone(redis, reservation_key(reply_id)))
    assert (await buckets.peek(user, Tier.FREE)).remaining_units == pytest.approx(6000 - 33, abs=0.5)


async def _is_gone(redis, key: str) -> bool:
    return await redis.exists(key) == 0


async def test_a_finished_reply_is_counted_once_in_the_usage_ledger_and_background_work_not_at_all(ready, nc, redis, store):
    """An OpenAI-endpoint reply (no turn to store) delivered twice counts once, with the usage and
    the served model its final event names; a summary (the background lane) is not billed."""
    user = uuid.uuid4().hex
    billed, background = uuid.uuid4().hex, uuid.uuid4().hex
    for reply_id, lane in ((billed, LANE_PAID), (background, LANE_BACKGROUND)):
        request = GenerateRequest(reply_id=reply_id, lane=lane, prompt_token_ids=list(range(9))).SerializeToString()
        await create_reply(redis, ReplyMeta(reply_id=reply_id, user_id=user, model="auto", request=request), track_readers=False)
    events = reply_events(billed, 4)
    events[-1].model = "large@2"
    events[-1].usage.cached_tokens = 5
    for event in events + events + reply_events(background, 3):
        await nc.publish(subjects.tokens(event.reply_id), encode(event))

    async def background_saved() -> bool:
        meta = await load_reply(redis, background)
        return meta is not None and not meta.is_running and not await redis.sismember(UNPERSISTED, background)

    await wait_until(background_saved)
    since = today_utc() - timedelta(days=1)
    rows = await wait_until(lambda: store.usage_of(user, since=since))
    assert [(row.model, row.messages, row.prompt_tokens, row.cached_tokens, row.completion_tokens) for row in rows] == [
        ("large@2", 1, 9, 5, 4)
    ]


class Outcomes:
    """The ReplyOutcomes published on tandem.v1.outcomes for the replies asked about, as they come."""

    def __init__(self, reply_ids: list[str]) -> None:
        loop = asyncio.get_running_loop()
        self.of: dict[str, asyncio.Future[ReplyOutcome]] = {reply_id: loop.create_future() for reply_id in reply_ids}

    async def on_message(self, msg) -> None:
        outcome = decode(msg.data, ReplyOutcome)
        future = self.of.get(outcome.reply_id)
        if future is not None and not future.done():
            future.set_result(outcome)


async def publish_reply(nc, events: list[TokenEvent]) -> None:
    """As a worker sends them: each stamped with when it was produced."""
    for event in events:
        event.produced_unix_ms = now_ms()
        await nc.publish(subjects.tokens(event.reply_id), encode(event))


async def test_a_shadow_reply_is_stored_as_a_shadow_answer_beside_the_reply_it_mirrors_never_as_a_turn_nor_billed(ready, nc, redis, store):
    """What chat creates for a request the rollout mirrors: a reply of the user's, on the candidate
    version, without a conversation of its own, in the background lane, shadowing the primary."""
    user, primary, shadow, conversation_id = (uuid.uuid4().hex for _ in range(4))
    outcomes = Outcomes([shadow])
    subscription = await nc.subscribe(subjects.OUTCOMES, cb=outcomes.on_message)
    await nc.flush()
    request = GenerateRequest(
        reply_id=shadow,
        user_id=user,
        conversation_id=conversation_id,
        lane=LANE_BACKGROUND,
        shadow_of=primary,
        prompt_token_ids=list(range(9)),
    )
    created_ms = now_ms() - 50  # its first token comes after its creation, on any clock
    meta = ReplyMeta(reply_id=shadow, user_id=user, model="large@2", request=request.SerializeToString(), created_ms=created_ms)
    await create_reply(redis, meta, track_readers=False)
    events = reply_events(shadow, 5)
    events[-1].model = "large@2"
    await publish_reply(nc, events)

    answers = await wait_until(lambda: store.shadow_answers(primary))
    assert len(answers) == 1
    answer = answers[0]
    assert (answer.reply_id, answer.shadow_of, answer.user_id, answer.conversation_id) == (shadow, primary, user, conversation_id)
    assert (answer.model, answer.text, answer.num_output_tokens) == ("large@2", "t1 t2 t3 t4 t5 ", 5)
    assert (answer.status, answer.finish, answer.stop_reason) == (ReplyStatus.COMPLETE, "stop", "")
    assert answer.ttft_s > 0 and answer.created_ms == created_ms and answer.finished_ms >= created_ms
    # Written in the same step as the answer, before it: had the ledger or a turn been due, they would be there.
    assert await store.usage_of(user, since=today_utc() - timedelta(days=1)) == []
    assert await store.get_message(shadow) is None
    outcome = await asyncio.wait_for(outcomes.of[shadow], 15)
    await subscription.unsubscribe()
    assert (outcome.model, outcome.is_shadow, outcome.is_error) == ("large@2", True, False)
    assert outcome.ttft_s == pytest.approx(answer.ttft_s)


async def test_every_finished_reply_publishes_its_outcome_once_stored_an_errored_one_as_an_error(ready, nc, redis):
    user, answered, errored = (uuid.uuid4().hex for _ in range(3))
    outcomes = Outcomes([answered, errored])
    subscription = await nc.subscribe(subjects.OUTCOMES, cb=outcomes.on_message)
    await nc.flush()
    for reply_id in (answered, errored):
        request = GenerateRequest(reply_id=reply_id, user_id=user, lane=LANE_PAID, prompt_token_ids=list(range(9))).SerializeToString()
        meta = ReplyMeta(reply_id=reply_id, user_id=user, model="large", request=request, created_ms=now_ms() - 50)
        await create_reply(redis, meta, track_readers=False)
    ok = reply_events(answered, 4)
    ok[-1].model = "large@1"
    failed = reply_events(errored, 3, finish=FINISH_REASON_ERROR)
    failed[-1].error.CopyFrom(Error(code="worker_lost", message="the worker went away"))
    await publish_reply(nc, ok + failed)

    done = await asyncio.wait_for(asyncio.gather(outcomes.of[answered], outcomes.of[errored]), 20)
    await subscription.unsubscribe()
    by_id = {outcome.reply_id: outcome for outcome in done}
    assert (by_id[answered].model, by_id[answered].is_error, by_id[answered].is_shadow) == ("large@1", False, False)
    assert 0 < by_id[answered].ttft_s < 30 and by_id[answered].finished_unix_ms > 0
    assert (by_id[errored].model, by_id[errored].is_error) == ("large", True)  # its final names no model: the meta's
    for reply_id in (answered, errored):  # published once stored: no longer listed as unstored
        assert not await redis.sismember(UNPERSISTED, reply_id)
