"""A reply's token log that vanishes (expired, or lost with Redis's data) while a client streams
it, on a real redis-server and nats-server: the product stream and the OpenAI stream each end
with a clear error instead of breaking off, and nothing of the reply is left in Redis."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import pytest_asyncio
import redis.asyncio as aioredis

from services.chat.models_view import ModelsView
from services.chat.openai_replies import CHAT, reply_chunks
from services.chat.replies import sse_stream
from services.chat.state import ChatConfig, ChatState
from tandem.bus import Bus, BusConfig, subjects
from tandem.bus.events import final_event
from tandem.store.sqlite import SqliteStore
from tandem.tokenlog import RUNNING, ReplyKeys, ReplyMeta, TokenLogWriter, create_reply
from tandem.v1.common_pb2 import FINISH_REASON_STOP
from tandem.v1.tokens_pb2 import TokenEvent

CONFIG = ChatConfig(
    system_prompt="",
    max_answer_tokens=16,
    prompt_budget_free=512,
    prompt_budget_plus=512,
    max_message_chars=1000,
    idempotency_ttl_s=60,
)


@pytest_asyncio.fixture
async def state(redis_server, nats_server, tmp_path) -> AsyncIterator[ChatState]:
    bus = Bus(BusConfig(url=nats_server.url, name="test-chat"))
    bus.start()
    await bus.wait_connected()
    store = SqliteStore(tmp_path / "conversations.db")
    await store.start()
    state = ChatState(
        config=CONFIG,
        instance_id="test-chat",
        api_keys={},
        store=store,
        redis=aioredis.from_url(redis_server.url, socket_timeout=10),
        stream_redis=aioredis.from_url(redis_server.url, socket_timeout=30),  # outlasts the reader's 5 s block
        bus=bus,
        models=ModelsView(),
    )
    yield state
    await state.redis.aclose()
    await state.stream_redis.aclose()
    await store.close()
    await bus.close()


async def started_reply(state: ChatState, num_tokens: int) -> str:
    """A reply as chat records it, with `num_tokens` tokens logged and more to come."""
    reply_id = uuid.uuid4().hex
    await create_reply(state.redis, ReplyMeta(reply_id=reply_id, model="m"), track_readers=True)
    writer = TokenLogWriter(state.redis, ttl_s=60)
    for seq in range(1, num_tokens + 1):
        await writer.append(TokenEvent(reply_id=reply_id, seq=seq, text=f"t{seq} "))
    return reply_id


async def vanish(state: ChatState, reply_id: str) -> None:
    await state.redis.delete(*ReplyKeys(reply_id).all())
    await state.redis.srem(RUNNING, reply_id)


async def nothing_left_of(state: ChatState, reply_id: str) -> bool:
    return await state.redis.exists(*ReplyKeys(reply_id).all()) == 0


async def test_a_log_that_vanishes_mid_stream_ends_the_product_stream_with_a_reply_expired_error(state):
    reply_id = await started_reply(state, 2)
    stream = sse_stream(state, reply_id, "m")
    head = [await anext(stream) for _ in range(3)]
    await vanish(state, reply_id)  # the reader now waits on a log that no longer exists
    rest = [event async for event in stream]
    assert [(e["id"], e["event"]) for e in head] == [("1", "meta"), ("2", "delta"), ("3", "delta")]
    assert [(e["id"], e["event"]) for e in rest] == [("4", "error")]
    assert json.loads(rest[0]["data"])["code"] == "reply_expired"
    assert await nothing_left_of(state, reply_id), "the reader's lease must not outlive the reply"


async def test_a_resumed_stream_whose_log_is_gone_gives_the_error_as_the_next_event(state):
    reply_id = uuid.uuid4().hex  # its log expired between the route's check and the first read
    events = [event async for event in sse_stream(state, reply_id, "m", last_event_id=7)]
    assert [(e["id"], e["event"]) for e in events] == [("8", "error")]
    assert json.loads(events[0]["data"])["code"] == "reply_expired"
    assert await nothing_left_of(state, reply_id)


async def test_a_log_that_vanishes_mid_stream_ends_the_openai_stream_with_an_error_and_cancels_the_reply(state):
    reply_id = await started_reply(state, 1)
    cancels = await state.bus.client.subscribe(subjects.cancel(reply_id))
    chunks = reply_chunks(state, reply_id, {"id": reply_id, "created": 0, "model": "m"}, CHAT, include_usage=False)
    head = [json.loads((await anext(chunks))["data"]) for _ in range(2)]
    await vanish(state, reply_id)
    rest = [chunk["data"] async for chunk in chunks]
    assert [c["choices"][0]["delta"] for c in head] == [{"role": "assistant", "content": ""}, {"content": "t1 "}]
    assert json.loads(rest[0])["error"]["code"] == "reply_expired" and rest[1:] == ["[DONE]"]
    cancel = await cancels.next_msg(timeout=5)
    assert cancel.subject == subjects.cancel(reply_id), "nobody can read the reply any more: it is stopped"
    await cancels.unsubscribe()


async def test_a_log_read_to_its_final_event_ends_with_done_not_an_error(state):
    reply_id = await started_reply(state, 2)
    await TokenLogWriter(state.redis, ttl_s=60).append(final_event(reply_id, 3, FINISH_REASON_STOP))
    events = [event async for event in sse_stream(state, reply_id, "m")]
    assert [e["event"] for e in events] == ["meta", "delta", "delta", "done"]
    await vanish(state, reply_id)
