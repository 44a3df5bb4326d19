"""The overload bench's client: answers with a length or chunked, cut anywhere on the wire, give
their status, headers, body and SSE events, and a connection read to the end carries the next
request; one the server asked to close does not."""

from __future__ import annotations

import asyncio
import json
import random
import socket

import pytest
from chat_client import Connection, Event, ProtocolError, read_events

from services.chat.sse import SseEvent

PING = b": ping - 2026-12-05 10:00:00\r\n\r\n"


def chunked(blobs: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(blob), blob) for blob in blobs) + b"0\r\n\r\n"


async def pair() -> tuple[Connection, socket.socket]:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    theirs.setblocking(False)
    return Connection(reader, writer), theirs


async def answer(theirs: socket.socket, wire: bytes, seed: int) -> bytes:
    """Reads one request head and body (Content-Length), then writes `wire` in random cuts."""
    loop = asyncio.get_running_loop()
    request = b""
    while b"\r\n\r\n" not in request:
        request += await loop.sock_recv(theirs, 4096)
    head, _, body = request.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += await loop.sock_recv(theirs, 4096)
    rng, at = random.Random(seed), 0
    while at < len(wire):
        cut = at + rng.randint(1, 40)
        await loop.sock_sendall(theirs, wire[at:cut])
        at = cut
    return head


@pytest.mark.parametrize("seed", range(5))
async def test_a_json_answer_then_an_sse_answer_on_one_kept_connection(seed):
    connection, theirs = await pair()
    created = b'{"id": "c1"}'
    json_wire = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(created), created)
    serving = asyncio.create_task(answer(theirs, json_wire, seed))
    first = await connection.request("POST", "/v1/conversations", "h:1", {"Authorization": "Bearer k"}, b"{}")
    assert (first.status, first.length, first.is_chunked) == (201, len(created), False)
    assert json.loads(await connection.body(first)) == {"id": "c1"}
    assert b"authorization: bearer k" in (await serving).lower()
    assert connection.is_reusable and connection.is_open

    deltas = [SseEvent(i, "delta", {"text": f"w{i} \n\n:"}).encode() for i in range(2, 12)]
    done = SseEvent(12, "done", {"finish": "stop", "usage": {"output": 10}}).encode()
    meta = SseEvent(1, "meta", {"message_id": "m"}).encode()
    body = chunked([meta + deltas[0], PING, *deltas[1:5], b"".join(deltas[5:]) + PING, done])
    sse_wire = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nretry-after: 3\r\ntransfer-encoding: chunked\r\n\r\n" + body
    serving = asyncio.create_task(answer(theirs, sse_wire, seed))
    second = await connection.request("POST", "/v1/conversations/c1/messages", "h:1", {}, b'{"content": "hi"}')
    assert (second.status, second.is_chunked, second.headers["retry-after"]) == (200, True, "3")
    events: list[Event] = []
    await read_events(connection, second, events.append)
    await serving
    assert [e.name for e in events] == ["meta"] + ["delta"] * 10 + ["done"]
    assert [json.loads(e.data)["text"] for e in events[1:-1]] == [f"w{i} \n\n:" for i in range(2, 12)]
    assert json.loads(events[-1].data)["usage"] == {"output": 10}
    assert connection.is_reusable, "read to its last chunk: the connection can carry another request"
    connection.close()
    theirs.close()


async def test_an_answer_asking_to_close_leaves_the_connection_unreusable_and_garbage_is_an_error():
    connection, theirs = await pair()
    text = b'{"error": {"code": "overloaded"}}'
    wire = b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text)
    serving = asyncio.create_task(answer(theirs, wire, 0))
    refused = await connection.request("POST", "/x", "h:1", {}, b"{}")
    assert refused.status == 503 and json.loads(await connection.body(refused))["error"]["code"] == "overloaded"
    await serving
    assert not connection.is_reusable
    connection.close()
    theirs.close()

    connection, theirs = await pair()
    serving = asyncio.create_task(answer(theirs, b"SSH-2.0-OpenSSH\r\n\r\n", 0))
    with pytest.raises(ProtocolError):
        await connection.request("GET", "/", "h:1", {}, b"")
    await serving
    connection.close()
    theirs.close()
