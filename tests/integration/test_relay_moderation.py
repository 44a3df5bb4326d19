"""The output check in the relay path, on real NATS, Redis and a relay process: token events are
published as a worker would; a window that trips the check gets the reply's worker a cancel
(reason "moderated"), ends the reply with a CONTENT_FILTER final event (the log takes nothing its
worker sends after), and stores the turn as moderated without its text. A final event whose last
window trips ends the reply moderated, not complete. Run once with a deployment's blocklist and
once with the default, profanity-check's trained model, each on its own servers and relay (one
relay each, so its metrics count every event)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from helpers import service_env, service_process, wait_until
from prometheus_client.parser import text_string_to_metric_families

from tandem.bus import decode, encode, subjects
from tandem.bus.events import ReplyStatus, now_ms
from tandem.devstack.servers import init_token_stream, start_nats, start_redis
from tandem.store import Conversation, NewMessage, Role
from tandem.store.sqlite import SqliteStore
from tandem.tokenlog import ReplyMeta, create_reply, load_reply, read
from tandem.v1.common_pb2 import FINISH_REASON_CONTENT_FILTER, FINISH_REASON_STOP, LANE_FREE, Usage
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import Cancel, TokenEvent

EVERY_TOKENS = 4
CLEAN = "Here is a short answer about baking bread at home: mix flour, water, salt and yeast, then let the dough rise for an hour. "
# What trips each check: a word the deployment listed; abuse the trained model was taught.
OFFENDING = {
    "blocklist:zanzibar|kumquat": "And then there is Zanzibar, which I will not explain. ",
    "profanity-check": "You are a fucking idiot and a stupid bitch. ",
}


@pytest.fixture(scope="module", params=list(OFFENDING), ids=["blocklist", "profanity-check"])
def check_spec(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def stack(tmp_path_factory, check_spec) -> Iterator[tuple[str, str, str, int]]:
    workdir = tmp_path_factory.mktemp("relay-moderation")
    nats_server, redis_server = start_nats(workdir), start_redis(workdir)
    init_token_stream(nats_server)  # the admin step: services only wait for the stream
    store_path = str(workdir / "conversations.db")
    env = service_env(
        "relay",
        nats_server.url,
        redis_server.url,
        TANDEM_SQLITE_PATH=store_path,
        TANDEM_OUTPUT_MODERATION=check_spec,
        TANDEM_OUTPUT_CHECK_EVERY_TOKENS=str(EVERY_TOKENS),
        TANDEM_STALL_TIMEOUT_S="60",  # no worker heartbeats here: replies must not be taken for lost
    )
    relay = service_process("relay", env)
    relay.start()
    yield nats_server.url, redis_server.url, store_path, int(env["TANDEM_OPS_PORT"])  # its /readyz and /metrics
    relay.stop(timeout_s=10)
    redis_server.stop()
    nats_server.stop()


@pytest_asyncio.fixture
async def nc(stack):
    client = await nats.connect(stack[0])
    yield client
    await client.close()


@pytest_asyncio.fixture
async def redis(stack):
    client = aioredis.from_url(stack[1], socket_timeout=10)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def store(stack):
    store = SqliteStore(Path(stack[2]))
    await store.start()
    yield store
    await store.close()


@pytest_asyncio.fixture
async def ready(stack):
    port = stack[3]

    async def answers() -> bool:
        try:
            async with httpx.AsyncClient() as http:
                return (await http.get(f"http://127.0.0.1:{port}/readyz", timeout=2)).status_code == 200
        except httpx.HTTPError:
            return False

    await wait_until(answers, timeout_s=60, interval_s=0.2)


async def relay_metric(port: int, name: str, **labels: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def running_turn(store: SqliteStore, redis, user: str) -> str:
    """A conversation whose assistant turn is running, recorded as chat records a free user's reply."""
    now = now_ms()
    conversation = await store.create_conversation(Conversation(uuid.uuid4().hex, user, "t", "m", now, now))
    reply_id = uuid.uuid4().hex
    await store.append_message(
        user,
        NewMessage(id=reply_id, conversation_id=conversation.id, role=Role.ASSISTANT, content="", tokens=0, status=ReplyStatus.RUNNING),
    )
    request = GenerateRequest(reply_id=reply_id, model="m", lane=LANE_FREE, prompt_token_ids=[1, 2, 3, 4, 5])
    meta = ReplyMeta(
        reply_id=reply_id,
        user_id=user,
        conversation_id=conversation.id,
        message_id=reply_id,
        model="m",
        request=request.SerializeToString(),
    )
    await create_reply(redis, meta, track_readers=False)
    return reply_id


def token_events(reply_id: str, text: str, first_seq: int = 1) -> list[TokenEvent]:
    """One event per word (with its space), as a worker of epoch 0 sends them."""
    words = [word + " " for word in text.split()]
    return [TokenEvent(reply_id=reply_id, seq=first_seq + i, token_id=i, text=word) for i, word in enumerate(words)]


def finished(events: list[TokenEvent]) -> list[TokenEvent]:
    events[-1].finish = FINISH_REASON_STOP
    events[-1].usage.CopyFrom(Usage(input_tokens=5, output_tokens=events[-1].seq))
    return events


async def publish(nc, events: list[TokenEvent]) -> None:
    for event in events:
        await nc.publish(subjects.tokens(event.reply_id), encode(event))


async def stored_turn(store: SqliteStore, reply_id: str):
    async def ended():
        message = await store.get_message(reply_id)
        return message if message.status != ReplyStatus.RUNNING else None

    return await wait_until(ended)


async def test_a_window_that_trips_the_check_cancels_the_reply_ends_it_content_filter_and_stores_no_text(
    ready, stack, check_spec, nc, redis, store
):
    port = stack[3]
    reply_id = await running_turn(store, redis, "u-trip")
    cancelled: asyncio.Future[Cancel] = asyncio.get_running_loop().create_future()

    async def on_cancel(msg):
        if not cancelled.done():
            cancelled.set_result(decode(msg.data, Cancel))

    subscription = await nc.subscribe(subjects.cancel(reply_id), cb=on_cancel)
    moderated_before = await relay_metric(port, "tandem_relay_moderated_total", direction="output", tier="free", model="m")
    # The worker writes on (no final event): only the check can end this reply.
    await publish(nc, token_events(reply_id, CLEAN + OFFENDING[check_spec] + CLEAN))
    cancel = await asyncio.wait_for(cancelled, 15)
    await subscription.unsubscribe()
    assert (cancel.reply_id, cancel.reason) == (reply_id, "moderated")

    logged = await asyncio.wait_for(_logged(redis, reply_id), 15)
    final = logged[-1]
    assert final.finish == FINISH_REASON_CONTENT_FILTER and final.text == "" and final.epoch == 1
    assert [event.seq for event in logged] == list(range(1, len(logged) + 1))
    assert final.usage.input_tokens == 5 and final.usage.output_tokens == final.seq - 1
    message = await stored_turn(store, reply_id)
    assert (message.status, message.content) == (ReplyStatus.MODERATED, "")
    assert (await load_reply(redis, reply_id)).status == ReplyStatus.MODERATED
    moderated = await relay_metric(port, "tandem_relay_moderated_total", direction="output", tier="free", model="m")
    assert moderated == moderated_before + 1

    # What the worker still sends (its old epoch, its own final) changes nothing.
    dropped_before = await relay_metric(port, "tandem_relay_events_dropped_total")
    late = finished(token_events(reply_id, "more words after the end", first_seq=final.seq))
    await publish(nc, late)
    await wait_until(lambda: _rose_by(port, "tandem_relay_events_dropped_total", dropped_before, len(late)))
    assert [event.seq for event in await _logged(redis, reply_id)] == [event.seq for event in logged]


async def test_a_final_event_whose_last_window_trips_ends_the_reply_moderated_not_complete(ready, check_spec, nc, redis, store):
    reply_id = await running_turn(store, redis, "u-last")
    clean = token_events(reply_id, CLEAN)
    num_checked = len(clean) // EVERY_TOKENS * EVERY_TOKENS  # the last check's turn: all clean up to it
    # The offending sentence comes in the final event, after the last turn: only the final's own check can see it.
    final = TokenEvent(reply_id=reply_id, seq=num_checked + 1, token_id=7, text=OFFENDING[check_spec], finish=FINISH_REASON_STOP)
    final.usage.CopyFrom(Usage(input_tokens=5, output_tokens=final.seq))
    await publish(nc, [*clean[:num_checked], final])

    logged = await asyncio.wait_for(_logged(redis, reply_id), 15)
    assert logged[-1].finish == FINISH_REASON_CONTENT_FILTER and logged[-1].text == ""
    assert logged[-1].seq == final.seq  # in the worker's final event's place
    assert logged[-1].usage.output_tokens == final.seq  # the worker's own count
    message = await stored_turn(store, reply_id)
    assert (message.status, message.content) == (ReplyStatus.MODERATED, "")


async def test_a_clean_reply_is_checked_and_ends_complete_with_its_text(ready, stack, nc, redis, store):
    port = stack[3]
    checks_before = await relay_metric(port, "tandem_relay_output_check_seconds_count")
    reply_id = await running_turn(store, redis, "u-clean")
    events = finished(token_events(reply_id, CLEAN * 3))
    await publish(nc, events)
    message = await stored_turn(store, reply_id)
    assert (message.status, message.content) == (ReplyStatus.COMPLETE, "".join(event.text for event in events))
    assert await relay_metric(port, "tandem_relay_output_check_seconds_count") > checks_before


async def _logged(redis, reply_id: str) -> list[TokenEvent]:
    return [event async for event in read(redis, reply_id, block_ms=5000)]


async def _rose_by(port: int, name: str, before: float, num: int) -> bool:
    return await relay_metric(port, name) >= before + num
