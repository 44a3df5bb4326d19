"""A reply's token log that vanishes (expired, or lost with Redis's data) while a client streams
it, on a real redis-server and nats-server: the product stream and the OpenAI stream each end
with a clear error instead of breaking off, and nothing of the reply is left in Redis. A stored
turn left running whose log is gone is settled as failed when read, with the text it had. A
generate request no router answers in time is cancelled (no generation runs untracked) and
answered with a 503 and a Retry-After."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from fastapi import FastAPI
from sse_starlette.sse import EventSourceResponse

from services.chat import metrics
from services.chat.attach_reads import AttachReads
from services.chat.auth import Authenticator
from services.chat.config import ChatConfig
from services.chat.errors import Unavailable, answer
from services.chat.fanout import open_fanout
from services.chat.key_ring import KeyRing
from services.chat.latency import ReplyClock
from services.chat.models_view import ModelsView
from services.chat.openai_replies import OpenAIAnswers
from services.chat.openai_shape import CHAT
from services.chat.replies import ReplyRequest, ReplyStarter
from services.chat.sse import StreamResponse
from services.chat.state import ChatState
from services.chat.stream_slots import StreamSlots
from services.chat.streaming import ReplyStreams
from services.router.dispatch import REFUSED, Attempt, DispatchConfig, DispatchResult, failure_event
from tandem.bus import Bus, BusConfig, decode, encode, subjects
from tandem.bus.events import ReplyStatus, final_event, now_ms
from tandem.config import ApiKey, Tier
from tandem.runtime.request_id import RequestIds
from tandem.store import Conversation, Message, NewMessage, Role
from tandem.store.sqlite import SqliteStore
from tandem.tokenlog import RUNNING, ReplyKeys, ReplyMeta, TokenLogWriter, create_reply, load_reply
from tandem.v1.common_pb2 import FINISH_REASON_STOP, SamplingParams
from tandem.v1.dispatch_pb2 import Assignment
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest, Refusal
from tandem.v1.tokens_pb2 import Cancel, TokenEvent

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
    redis = aioredis.from_url(redis_server.url, socket_timeout=10)
    fanout = open_fanout(CONFIG, redis_server.url, redis, "test-chat")
    state = ChatState(
        config=CONFIG,
        auth=Authenticator(KeyRing.load({}, None)),
        store=store,
        redis=redis,
        fanout=fanout,
        attach_reads=AttachReads.of(redis, fanout, CONFIG),
        stream_slots=StreamSlots(CONFIG.max_streams, CONFIG.stream_limits()),
        bus=bus,
        models=ModelsView(),
    )
    yield state
    await state.fanout.close()
    await state.redis.aclose()
    await store.close()
    await bus.close()


def streams_of(state: ChatState) -> ReplyStreams:
    return ReplyStreams.of(state.fanout, state.redis, state.store, state.config)


def starter_of(state: ChatState) -> ReplyStarter:
    return ReplyStarter(state.redis, state.bus, state.door, state.quotas, state.config.generate_timeout_s)


def answers_of(state: ChatState) -> OpenAIAnswers:
    return OpenAIAnswers(
        starter_of(state),
        state.fanout,
        state.bus,
        state.tokenizer,
        answer_lengths=state.config.answer_lengths(),
        prompt_budget=state.config.prompt_budget,
        keepalive_s=state.config.keepalive_s,
    )


def parsed(chunk: bytes) -> list[dict[str, str]]:
    """The SSE events in one written chunk (a stream writes several at once when it has them)."""
    events = []
    for block in chunk.decode().split("\r\n\r\n"):
        if block.strip():
            events.append(dict(line.split(": ", 1) for line in block.split("\r\n") if not line.startswith(":")))
    return events


async def take(stream: AsyncIterator[bytes], num_events: int) -> list[dict[str, str]]:
    events: list[dict[str, str]] = []
    while len(events) < num_events:
        events.extend(parsed(await anext(stream)))
    return events


async def rest_of(stream: AsyncIterator[bytes]) -> list[dict[str, str]]:
    return [event async for chunk in stream for event in parsed(chunk)]


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
    stream = streams_of(state).sse_stream(reply_id, "m")
    head = await take(stream, 3)
    await vanish(state, reply_id)  # the reader now waits on a log that no longer exists
    rest = await rest_of(stream)
    assert [(e["id"], e["event"]) for e in head] == [("1", "meta"), ("2", "delta"), ("3", "delta")]
    assert [(e["id"], e["event"]) for e in rest] == [("4", "error")]
    assert json.loads(rest[0]["data"])["code"] == "reply_expired"
    assert await nothing_left_of(state, reply_id), "the reader's lease must not outlive the reply"


async def test_a_resumed_stream_whose_log_is_gone_gives_the_error_as_the_next_event(state):
    reply_id = uuid.uuid4().hex  # its log expired between the route's check and the first read
    events = await rest_of(streams_of(state).sse_stream(reply_id, "m", last_event_id=7))
    assert [(e["id"], e["event"]) for e in events] == [("8", "error")]
    assert json.loads(events[0]["data"])["code"] == "reply_expired"
    assert await nothing_left_of(state, reply_id)


async def test_a_log_that_vanishes_mid_stream_ends_the_openai_stream_with_an_error_and_cancels_the_reply(state):
    reply_id = await started_reply(state, 1)
    cancels = await state.bus.client.subscribe(subjects.cancel(reply_id))
    clock = ReplyClock("plus", "m", arrived_s=0.0)
    chunks = answers_of(state).reply_chunks(
        [reply_id], {"id": reply_id, "created": 0, "model": "m"}, CHAT, include_usage=False, clock=clock
    )
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
    events = await rest_of(streams_of(state).sse_stream(reply_id, "m"))
    assert [e["event"] for e in events] == ["meta", "delta", "delta", "done"]
    await vanish(state, reply_id)


USER = ApiKey(user_id="u1", tier=Tier.PLUS)
LONG_AGO_MS = 120_000  # well past the grace a turn has to get its log


async def running_turn(state: ChatState, *, content: str = "", age_ms: int = LONG_AGO_MS) -> Message:
    """An assistant turn stored as running `age_ms` ago, as chat stores it before the reply starts."""
    conversation = Conversation(
        id=uuid.uuid4().hex, user_id=USER.user_id, title="t", model="m", created_at_ms=now_ms(), updated_at_ms=now_ms()
    )
    await state.store.create_conversation(conversation)
    question = await state.store.append_message(USER.user_id, NewMessage(uuid.uuid4().hex, conversation.id, Role.USER, "hi", 1))
    turn = NewMessage(
        id=uuid.uuid4().hex,
        conversation_id=conversation.id,
        role=Role.ASSISTANT,
        content=content,
        tokens=0,
        model="m",
        status=ReplyStatus.RUNNING,
        parent_seq=question.seq,
        created_at_ms=now_ms() - age_ms,
    )
    return await state.store.append_message(USER.user_id, turn)


async def stored(state: ChatState, message: Message) -> Message:
    found = await state.store.get_message(message.id)
    assert found is not None
    return found


async def body_of(response) -> list[dict[str, str]]:
    return [event async for event in response.body_iterator]


async def test_a_running_turn_whose_log_is_gone_is_read_as_failed_and_stored_so(state):
    turn = await running_turn(state, content="partial")
    shown = await streams_of(state).as_logged(turn)
    assert (shown.status, shown.content) == (ReplyStatus.FAILED, "partial")
    assert (await stored(state, turn)).status == ReplyStatus.FAILED, "settled in the store, not only in the view"


async def test_streaming_a_lost_running_turn_gives_its_text_and_a_final_error_not_a_503(state):
    turn = await running_turn(state, content="partial")
    events = await body_of(streams_of(state).finished_response(turn, last_event_id=0))
    assert [(e["id"], e["event"]) for e in events] == [("1", "meta"), ("2", "delta"), ("3", "error")]
    assert json.loads(events[1]["data"]) == {"text": "partial"}
    assert json.loads(events[2]["data"])["code"] == "failed"
    assert (await stored(state, turn)).status == ReplyStatus.FAILED


async def test_a_client_resuming_a_lost_running_turn_gets_the_final_error_as_its_next_event(state):
    turn = await running_turn(state)
    events = await body_of(streams_of(state).finished_response(turn, last_event_id=5))
    assert [(e["id"], e["event"]) for e in events] == [("6", "error")]
    assert (await stored(state, turn)).status == ReplyStatus.FAILED


async def test_a_turn_stored_a_moment_ago_without_its_log_yet_is_not_settled(state):
    turn = await running_turn(state, age_ms=0)
    with pytest.raises(Unavailable) as refused:
        streams_of(state).finished_response(turn, last_event_id=0)
    assert refused.value.code == "reply_unreadable" and refused.value.retry_after_s > 0
    assert (await streams_of(state).as_logged(turn)).status == ReplyStatus.RUNNING
    assert (await stored(state, turn)).status == ReplyStatus.RUNNING


async def test_a_turn_whose_log_ended_before_the_relay_stored_it_reads_with_the_version_that_wrote_it(state):
    turn = await running_turn(state)  # asked of "m"; the router sent it to version 1
    await create_reply(state.redis, ReplyMeta(reply_id=turn.id, model="m"), track_readers=True)
    writer = TokenLogWriter(state.redis, ttl_s=60)
    await writer.append(TokenEvent(reply_id=turn.id, seq=1, text="red"))
    final = final_event(turn.id, 2, FINISH_REASON_STOP)
    final.model = "m@1"
    await writer.append(final)
    shown = await streams_of(state).as_logged(turn)
    assert (shown.status, shown.content, shown.model) == (ReplyStatus.COMPLETE, "red", "m@1")
    await vanish(state, turn.id)


async def test_a_log_that_vanishes_mid_stream_settles_its_stored_turn_as_failed_with_the_text_streamed(state):
    turn = await running_turn(state)
    await create_reply(state.redis, ReplyMeta(reply_id=turn.id, message_id=turn.id, model="m"), track_readers=True)
    writer = TokenLogWriter(state.redis, ttl_s=60)
    for seq in (1, 2):
        await writer.append(TokenEvent(reply_id=turn.id, seq=seq, text=f"t{seq} "))
    stream = streams_of(state).sse_stream(turn.id, "m")
    head = await take(stream, 3)
    await vanish(state, turn.id)
    rest = await rest_of(stream)
    assert [e["event"] for e in head + rest] == ["meta", "delta", "delta", "error"]
    settled = await stored(state, turn)
    assert (settled.status, settled.content) == (ReplyStatus.FAILED, "t1 t2 ")


def reply_request() -> ReplyRequest:
    return ReplyRequest(
        reply_id=uuid.uuid4().hex,
        user=USER,
        model="m",
        prompt_ids=[1, 2, 3],
        public_prefix_tokens=0,
        sampling=SamplingParams(max_tokens=4),
    )


async def test_a_generate_no_router_answers_in_time_is_cancelled_and_answered_503_with_retry_after(state):
    state.config = dataclasses.replace(CONFIG, generate_timeout_s=0.5)
    client = state.bus.client
    heard: asyncio.Queue[str] = asyncio.Queue()

    async def slow_router(msg) -> None:  # takes the request and never answers
        await heard.put(msg.subject)

    silent = await client.subscribe(subjects.GENERATE, queue="router", cb=slow_router)
    reply = reply_request()
    cancels = await client.subscribe(subjects.cancel(reply.reply_id))
    await client.flush()
    try:
        with pytest.raises(Unavailable) as refused:
            await starter_of(state).start_reply(reply)
        assert await asyncio.wait_for(heard.get(), 5) == subjects.GENERATE, "the request did reach a router"
        cancel = decode((await cancels.next_msg(timeout=5)).data, Cancel)
        assert cancel.reply_id == reply.reply_id, "the reply a slow router may still start is cancelled"
    finally:
        await silent.unsubscribe()
        await cancels.unsubscribe()
    assert refused.value.code == "router_timeout"
    response = await answer(None, refused.value)  # type: ignore[arg-type]
    assert response.status_code == 503 and response.headers["Retry-After"] == "2"
    assert await nothing_left_of(state, reply.reply_id)
    assert not await state.redis.sismember(RUNNING, reply.reply_id)


async def test_a_generate_with_no_router_running_is_503_once_the_generate_timeout_is_spent(state):
    state.config = dataclasses.replace(CONFIG, generate_timeout_s=0.3)
    resent = metrics.GENERATE_RESENT._value.get()
    reply = reply_request()
    with pytest.raises(Unavailable) as refused:
        await starter_of(state).start_reply(reply)
    assert refused.value.code == "no_router" and refused.value.retry_after_s > 0
    assert metrics.GENERATE_RESENT._value.get() > resent, "it was sent again before giving up"
    assert await nothing_left_of(state, reply.reply_id)


async def test_a_generate_sent_while_no_router_runs_reaches_the_router_that_comes_up(state):
    """A rolling restart of the only router: the request waits for the new one, not a 503."""
    client = state.bus.client
    resent = metrics.GENERATE_RESENT._value.get()
    reply = reply_request()
    begun = asyncio.create_task(starter_of(state).start_reply(reply))
    try:
        while metrics.GENERATE_RESENT._value.get() == resent:  # it found no router at least once
            assert not begun.done(), begun
            await asyncio.wait({begun}, timeout=0.02)

        async def router(msg) -> None:
            await msg.respond(encode(GenerateReply(reply_id=reply.reply_id, model="m")))

        subscription = await client.subscribe(subjects.GENERATE, queue="router", cb=router)
        try:
            assert (await asyncio.wait_for(begun, 10)).model == "m"
        finally:
            await subscription.unsubscribe()
    finally:
        begun.cancel()


async def test_a_reply_the_router_admits_for_another_model_is_recorded_with_that_model(state):
    client = state.bus.client

    async def router(msg) -> None:  # the small pool is down: the large model takes it
        await msg.respond(encode(GenerateReply(reply_id=decode(msg.data, GenerateRequest).reply_id, model="large")))

    answering = await client.subscribe(subjects.GENERATE, queue="router", cb=router)
    await client.flush()
    reply = dataclasses.replace(reply_request(), model="small")
    try:
        assert (await starter_of(state).start_reply(reply)).model == "large"
    finally:
        await answering.unsubscribe()
    meta = await load_reply(state.redis, reply.reply_id)
    assert meta is not None and meta.model == "large", "a stream resumed later names the admitted model"
    assert await state.redis.ttl(ReplyKeys(reply.reply_id).meta) > 0


def request_id_app(state: ChatState) -> RequestIds:
    """The chat's two ways of streaming a reply behind the request-id middleware every service's app has."""
    app = FastAPI()

    @app.get("/live/{reply_id}")
    async def live(reply_id: str) -> StreamResponse:
        return streams_of(state).response(reply_id, "m")

    @app.get("/stored/{message_id}")
    async def stored_turn(message_id: str) -> EventSourceResponse:
        message = await state.store.get_message(message_id)
        assert message is not None
        return streams_of(state).finished_response(message, last_event_id=0)

    return RequestIds(app)


async def error_of(client: httpx.AsyncClient, path: str, request_id: str) -> tuple[dict[str, object], httpx.Response]:
    response = await client.get(path, headers={"X-Request-Id": request_id})
    assert response.status_code == 200, response.text
    events = parsed(response.content)
    assert events[-1]["event"] == "error", events
    return json.loads(events[-1]["data"]), response


async def test_a_failed_replys_stream_error_names_the_streaming_requests_id_and_nothing_internal(state, caplog):
    host, pid = socket.gethostname(), os.getpid()
    workers = [f"decode-{host}-{pid}-{n}" for n in range(2)]  # worker ids as the stack names them
    attempts = tuple(Attempt(w, REFUSED, refusal=Refusal(reason="overloaded", message=f"KV full on {host} pid {pid}")) for w in workers)
    reply_id = await started_reply(state, 2)
    failed = failure_event(Assignment(reply_id=reply_id, first_seq=3), DispatchResult(attempts), DispatchConfig())
    assert workers[0] in DispatchResult(attempts).describe(), "the router's log line has what the client must not see"
    await TokenLogWriter(state.redis, ttl_s=60).append(failed)
    lost = await running_turn(state, content="partial")
    transport = httpx.ASGITransport(app=request_id_app(state))
    caplog.set_level(logging.INFO, logger="services.chat.streaming")
    async with httpx.AsyncClient(transport=transport, base_url="http://chat") as client:
        for path, code in ((f"/live/{reply_id}", "overloaded"), (f"/stored/{lost.id}", "failed")):
            for request_id in (f"first-{uuid.uuid4().hex[:8]}", f"later-{uuid.uuid4().hex[:8]}"):  # the log's one error, two readers
                error, response = await error_of(client, path, request_id)
                assert (error["code"], error["request_id"]) == (code, request_id) and error["message"]
                assert response.headers["x-request-id"] == request_id
                leaked = [word for word in (*workers, f"on {host}", f"pid {pid}", "KV full") if word in response.text]
                assert not leaked, f"{leaked} in {response.text}"
                if path.startswith("/live/"):  # the id a client quotes finds the reply, whose details the router logged
                    assert f"request {request_id}: reply {reply_id} ended with error overloaded" in caplog.text
    await vanish(state, reply_id)
