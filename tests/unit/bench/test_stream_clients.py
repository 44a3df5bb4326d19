"""The stream bench's client parser: a chunked SSE body cut anywhere, keep-alives included, gives
the events' count, contiguity and chain as the reply's log gives them; a lost event shows."""

from __future__ import annotations

import random

from stream_clients import Job, SseStream, StreamResult, expected_chain

from services.chat.sse import SseEvent

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
PING = b": ping - 2026-12-02 10:00:00\r\n\r\n"


def log_events(num: int) -> list[bytes]:
    events = [SseEvent(i, "delta", {"text": f"w{i} \r\n\r\n:"}).encode() for i in range(2, num + 2)]
    return [*events, SseEvent(num + 2, "done", {"finish": "stop"}).encode()]


def chunked(blobs: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(blob), blob) for blob in blobs) + b"0\r\n\r\n"


def received(body: bytes, seed: int) -> StreamResult:
    """`body` fed to a stream in random cuts, until it has its final event (it closes its
    connection then, and reads nothing more)."""
    result = StreamResult("r")
    stream = SseStream(Job("h", 1, "k", ["r"]), result, 0, on_answer=lambda: None, on_end=lambda _: None)
    wire, rng, at = HEAD + body, random.Random(seed), 0
    while at < len(wire) and not result.is_done:
        cut = at + rng.randint(1, 60)
        stream.data_received(wire[at:cut])
        at = cut
    return result


def test_a_body_cut_anywhere_with_keepalives_gives_the_logs_events_and_chain():
    events = log_events(40)
    meta = SseEvent(1, "meta", {"message_id": "r"}).encode()
    blobs = [meta + events[0], PING, *events[1:10], b"".join(events[10:30]), PING + events[30], b"".join(events[31:])]
    for seed in range(20):
        result = received(chunked(blobs), seed)
        assert (result.status, result.num_events, result.is_contiguous, result.is_done) == (200, 42, True, True)
        assert result.chain == expected_chain(events) and len(result.arrivals_s) == 42


def test_a_lost_event_breaks_the_ids_and_the_chain():
    events = log_events(10)
    meta = SseEvent(1, "meta", {"message_id": "r"}).encode()
    result = received(chunked([meta, *events[:4], *events[5:]]), seed=1)
    assert not result.is_contiguous and result.chain != expected_chain(events)
