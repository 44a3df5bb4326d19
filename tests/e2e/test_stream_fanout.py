"""Streaming at scale (issue 12) on the product stack's workers, relays and Redis, through two
extra chat instances of this module's own: "wide" (per-user limits: plus 2000, free 3; a 32-event
buffer per client) and "narrow" (TANDEM_MAX_STREAMS=12).

500 readers of one running reply all receive its complete log, identically; a client that stops
reading does not hold up the others and, read on or resumed with Last-Event-ID, gets the same
sequence; past the instance's capacity a new stream is a 503 with Retry-After while the streams
it holds carry on; past a user's limit a new stream is a 429 with Retry-After."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import nats
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from helpers import next_heartbeat, ops_url, service_env, service_process
from product_stack import ALICE, API_KEYS, BOB, READER_IDLE_TIMEOUT_S, Sse, parse_sse, sse_events
from scraped_metrics import grew, scrape

from services.chat.sse import sse_events as sse_of_log
from tandem.tokenlog import load_reply, logged_events

pytestmark = pytest.mark.real_model
NARROW_MAX_STREAMS = 12
FREE_STREAM_LIMIT = 3


@pytest_asyncio.fixture(scope="module")
async def chats(product_stack) -> AsyncIterator[dict[str, str]]:
    """The URLs of the two extra chat instances ("wide", "narrow"; their ops ports' "wide-ops",
    "narrow-ops"), ready and knowing the served model."""
    common = {
        "TANDEM_STORE": "sqlite", "TANDEM_SQLITE_PATH": str(product_stack.store_path), "TANDEM_API_KEYS": API_KEYS,
        "TANDEM_READER_IDLE_TIMEOUT_S": str(READER_IDLE_TIMEOUT_S), "TANDEM_MAX_ANSWER_TOKENS": "400",
    }  # fmt: skip
    envs = {
        "wide": service_env("chat", product_stack.nats_url, product_stack.redis_url, **common, TANDEM_STREAM_LIMIT_PLUS="2000",
                            TANDEM_STREAM_LIMIT_FREE=str(FREE_STREAM_LIMIT), TANDEM_STREAM_BUFFER_EVENTS="32"),
        "narrow": service_env("chat", product_stack.nats_url, product_stack.redis_url, **common,
                              TANDEM_MAX_STREAMS=str(NARROW_MAX_STREAMS), TANDEM_STREAM_LIMIT_PLUS="2000"),
    }  # fmt: skip
    children = {name: service_process("chat", env) for name, env in envs.items()}
    for child in children.values():
        child.start()
    nc = await nats.connect(product_stack.nats_url)
    try:
        for env in envs.values():
            await next_heartbeat(nc, "chat", env["TANDEM_INSTANCE_ID"], accept=lambda hb: hb.is_ready, timeout_s=60)
        for _ in range(2):  # chat learns the served model from a decode heartbeat
            await next_heartbeat(nc, "decode", product_stack.ids["decode"][0], timeout_s=30)
        yield {name: f"http://127.0.0.1:{env['TANDEM_HTTP_PORT']}" for name, env in envs.items()} | {
            f"{name}-ops": ops_url(env) for name, env in envs.items()
        }
    finally:
        await nc.close()
        for child in children.values():
            child.stop(timeout_s=10)


def client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0))


class Reply:
    """A long reply started by POSTing a message, its own stream read to the end in a task."""

    def __init__(self, http: httpx.AsyncClient, headers: dict[str, str], max_tokens: int) -> None:
        self._http, self._headers, self._max_tokens = http, headers, max_tokens
        self.id = ""
        self._reading: asyncio.Task[list[Sse]] | None = None

    async def start(self) -> Reply:
        conversation = await self._http.post("/v1/conversations", headers=self._headers, json={})
        assert conversation.status_code == 201, conversation.text
        started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        body = {"content": "Write a long story about a lighthouse keeper.", "temperature": 0, "max_tokens": self._max_tokens}
        self._reading = asyncio.create_task(self._read(f"/v1/conversations/{conversation.json()['id']}/messages", body, started))
        self.id = await started
        return self

    async def _read(self, path: str, body: dict, started: asyncio.Future[str]) -> list[Sse]:
        async with self._http.stream("POST", path, headers=self._headers, json=body) as response:
            assert response.status_code == 200, (await response.aread()).decode()
            started.set_result(response.headers["x-message-id"])
            events = [event async for event in sse_events(response)]
        return await read_on(self._http, started.result(), self._headers, events)

    async def finished(self) -> list[Sse]:
        assert self._reading is not None
        return await self._reading


async def log_sequence(redis_url: str, reply_id: str) -> list[tuple[int, str, dict]]:
    """The reply's SSE events after `meta`, from its whole token log in Redis."""
    redis = aioredis.from_url(redis_url)
    try:
        events = await logged_events(redis, reply_id)
    finally:
        await redis.aclose()
    return [(sse.id, sse.event, sse.data) for event in events for sse in sse_of_log(event)]


async def read_whole(
    http: httpx.AsyncClient, reply_id: str, headers: dict[str, str], last_event_id: int = 0, opening: asyncio.Semaphore | None = None
) -> list[Sse]:
    """One stream of the reply, read to its end as bytes and parsed once (cheap for many readers).
    `opening`: bounds the requests awaiting their answer at once, as a crowd of browsers spreads
    its connects."""
    resume = {"Last-Event-ID": str(last_event_id)} if last_event_id else {}
    request = http.build_request("GET", f"/v1/messages/{reply_id}/stream", headers={**headers, **resume})
    async with opening or contextlib.nullcontext():
        response = await http.send(request, stream=True)
    try:
        body = await response.aread()
    finally:
        await response.aclose()
    assert response.status_code == 200, (response.status_code, body.decode())
    return parse_sse(body.decode())


async def read_on(
    http: httpx.AsyncClient,
    reply_id: str,
    headers: dict[str, str],
    events: list[Sse],
    max_resumes: int = 50,
    opening: asyncio.Semaphore | None = None,
) -> list[Sse]:
    """`events` and the rest of the reply: a stream that ended before `done` (the instance
    dropped a client that fell behind) resumes with Last-Event-ID, as a browser does."""
    for _ in range(max_resumes):
        if events and events[-1].event in ("done", "error"):
            return events
        events = events + await read_whole(http, reply_id, headers, events[-1].id if events else 0, opening)
    raise AssertionError(f"no end after {max_resumes} resumes: {events[-3:]}")


def after_meta(events: list[Sse]) -> list[tuple[int, str, dict]]:
    assert events and (events[0].id, events[0].event) == (1, "meta"), events[:1]
    return [(e.id, e.event, e.data) for e in events[1:]]


async def test_500_readers_of_one_running_reply_receive_its_identical_complete_log(chats, product_stack):
    async with client(chats["wide"]) as http:
        before = await scrape(http, chats["wide-ops"])
        reply = await Reply(http, ALICE, max_tokens=48).start()
        opening = asyncio.Semaphore(32)
        readers = await asyncio.gather(*(read_on(http, reply.id, ALICE, [], opening=opening) for _ in range(500)))
        own = await reply.finished()
        after = await scrape(http, chats["wide-ops"])
    # Readers waiting at the log's end were written live events by the reply's feed (uvicorn's
    # connections), the rest by their own tasks: the sequences below are equal either way.
    assert grew(before, after, "tandem_chat_stream_direct_writes_total") > 0
    expected = await log_sequence(product_stack.redis_url, reply.id)
    assert expected[-1][1] == "done" and [i for i, _, _ in expected] == list(range(2, len(expected) + 2))
    assert after_meta(own) == expected
    mismatched = [n for n, events in enumerate(readers) if after_meta(events) != expected]
    assert mismatched == [], f"{len(mismatched)} of 500 readers got another sequence, e.g. reader {mismatched[:1]}"


async def test_a_paused_client_does_not_delay_the_others_and_resumes_without_loss(chats, product_stack):
    async with client(chats["wide"]) as http:
        reply = await Reply(http, ALICE, max_tokens=48).start()
        path = f"/v1/messages/{reply.id}/stream"
        async with http.stream("GET", path, headers=ALICE) as slow_response:
            assert slow_response.status_code == 200
            slow_events = sse_events(slow_response)
            head = [await anext(slow_events) for _ in range(3)]
            # Paused: nothing reads its socket while the others read the reply to its end.
            others = await asyncio.wait_for(asyncio.gather(*(read_on(http, reply.id, ALICE, []) for _ in range(5))), timeout=300)
            assert all(events[-1].event == "done" for events in others)
            rest = [event async for event in slow_events]  # reads on: the rest, or up to where it was dropped
        combined = await read_on(http, reply.id, ALICE, head + rest)  # dropped: resumes after the last event it got
        await reply.finished()
    expected = await log_sequence(product_stack.redis_url, reply.id)
    assert [e.id for e in combined] == list(range(1, len(combined) + 1)), "ids contiguous across the resume"
    assert after_meta(combined) == expected
    assert all(after_meta(events) == expected for events in others)


async def open_stream(http: httpx.AsyncClient, reply_id: str, headers: dict[str, str]) -> tuple[httpx.Response, AsyncIterator[Sse]]:
    response = await http.send(http.build_request("GET", f"/v1/messages/{reply_id}/stream", headers=headers), stream=True)
    return response, sse_events(response)


def assert_refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, (response.status_code, response.text)
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert error["code"] == code and set(error) >= {"message", "type", "code", "param"} and error["message"]


async def test_past_the_instance_capacity_a_new_stream_is_503_with_retry_after_and_held_streams_carry_on(chats, product_stack):
    async with client(chats["wide"]) as wide, client(chats["narrow"]) as narrow:
        reply = await Reply(wide, ALICE, max_tokens=64).start()
        held = [await open_stream(narrow, reply.id, ALICE) for _ in range(NARROW_MAX_STREAMS)]
        assert [response.status_code for response, _ in held] == [200] * NARROW_MAX_STREAMS
        for _ in range(3):
            refused = await narrow.get(f"/v1/messages/{reply.id}/stream", headers=ALICE)
            assert_refused(refused, 503, "streams_full")
        read = [await read_on(narrow, reply.id, ALICE, [event async for event in events]) for _, events in held]
        for response, _ in held:
            await response.aclose()
        expected = await log_sequence(product_stack.redis_url, reply.id)
        assert all(after_meta(events) == expected for events in read), "held streams carry on to the end"
        again = await read_on(narrow, reply.id, ALICE, [])  # their slots are free again
        assert after_meta(again) == expected
        await reply.finished()


async def test_past_a_users_stream_limit_a_new_stream_is_429_with_retry_after(chats, product_stack):
    async with client(chats["wide"]) as http:
        reply = await Reply(http, BOB, max_tokens=64).start()  # its own stream is one of bob's
        held, refused = [], None
        for _ in range(FREE_STREAM_LIMIT + 1):
            response, events = await open_stream(http, reply.id, BOB)
            if response.status_code != 200:
                refused = response
                await response.aread()
                break
            held.append((response, events))
        assert refused is not None, f"bob held {len(held)} streams beside his reply's own with a limit of {FREE_STREAM_LIMIT}"
        assert len(held) in (FREE_STREAM_LIMIT - 1, FREE_STREAM_LIMIT), "refused at the limit, not before"
        assert_refused(refused, 429, "too_many_streams")
        read = [await read_on(http, reply.id, BOB, [event async for event in events]) for _, events in held]
        for response, _ in held:
            await response.aclose()
        own = await reply.finished()
    expected = await log_sequence(product_stack.redis_url, reply.id)
    assert after_meta(own) == expected and all(after_meta(events) == expected for events in read)


async def test_a_running_reply_streams_to_its_owner_and_is_not_found_for_anyone_else(chats, product_stack):
    """A running reply's stream is answered from its log's meta (whose reply it is), without the
    store: the owner gets it, another key gets the same 404 as for a message that does not exist."""
    redis = aioredis.from_url(product_stack.redis_url)
    try:
        async with client(chats["wide"]) as http:
            reply = await Reply(http, ALICE, max_tokens=48).start()
            refused = await http.get(f"/v1/messages/{reply.id}/stream", headers=BOB)
            was_running = (await load_reply(redis, reply.id)).is_running
            own = await read_on(http, reply.id, ALICE, [])
            await reply.finished()
    finally:
        await redis.aclose()
    assert was_running, "the reply ended before the refusal was checked: make it longer"
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "message_not_found"
    assert own[-1].event == "done" and after_meta(own) == await log_sequence(product_stack.redis_url, reply.id)
