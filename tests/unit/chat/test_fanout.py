"""A feed's fan-out without Redis: every subscriber takes the same events, a late one starts from
its Last-Event-ID, a slow one is dropped (only for live events it let pile up, never for a
backlog), a failure reaches each subscriber; live events are written by the feed to the
connections that wait for them, and only those; and the stream slots' limits."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import REGISTRY

from services.chat.direct_write import DirectWriter
from services.chat.errors import RateLimited, Unavailable
from services.chat.fanout import Feed, Subscription
from services.chat.sse import encode_frames, meta_event
from services.chat.stream_slots import StreamSlots
from tandem.bus.events import error_event, final_event, now_ms
from tandem.config import ApiKey, Tier
from tandem.tokenlog import ReplyGone
from tandem.v1.common_pb2 import FINISH_REASON_STOP
from tandem.v1.tokens_pb2 import TokenEvent


def tokens(first: int, last: int) -> list[TokenEvent]:
    return [TokenEvent(reply_id="r", seq=seq, text=f"t{seq} ") for seq in range(first, last + 1)]


def new_feed() -> Feed:
    return Feed("r", "reader", lambda feed, error: feed.finish(error))


async def taken(subscription: Subscription, after_id: int = 1, request_id: str = "req") -> bytes:
    """Everything the subscription gets until its feed finishes, as one client would write it."""
    parts = [subscription.feed.sse_bytes(start, stop, after_id, request_id) async for start, stop in subscription.ranges()]
    return b"".join(parts)


def expected(events: list[TokenEvent], after_id: int = 1) -> bytes:
    return b"".join(data for event in events for sse_id, data in encode_frames(event).each if sse_id > after_id)


async def test_every_subscriber_takes_the_identical_complete_sequence():
    feed = new_feed()
    subscriptions = [feed.subscribe(0, max_lag=8) for _ in range(20)]
    readers = [asyncio.create_task(taken(s)) for s in subscriptions]
    events = [*tokens(1, 5), final_event("r", 6, FINISH_REASON_STOP)]
    for event in events:
        feed.deliver([event], is_caught_up=True)
        await asyncio.sleep(0)  # let the clients take what is there, as the loop does between reads
    feed.end(None)
    results = await asyncio.gather(*readers)
    assert set(results) == {expected(events)}
    assert b"event: done" in results[0]


async def test_clients_joining_at_the_start_share_one_bytes_object_equal_to_the_events_frames():
    feed = new_feed()
    events = tokens(1, 40)
    feed.deliver(events[:30], is_caught_up=True)
    first, second = feed.sse_bytes(0, 30, 1, "a"), feed.sse_bytes(0, 30, 1, "b")
    assert first == expected(events[:30]) and second is first
    feed.deliver(events[30:], is_caught_up=True)
    assert feed.sse_bytes(0, 40, 1, "c") == expected(events)
    assert feed.sse_bytes(0, 30, 1, "d") == expected(events[:30]), "a shorter range than the kept prefix"
    assert feed.sse_bytes(0, 40, 2, "e") == expected(events, after_id=2), "a client past the first id"


async def test_a_client_joining_a_failed_reply_at_the_start_is_told_its_own_request_id():
    feed = new_feed()
    events = [*tokens(1, 3), error_event("r", 4, "worker_lost", "gone")]
    feed.deliver(events, is_caught_up=True)
    for request_id in ("first", "second"):
        data = feed.sse_bytes(0, 4, 1, request_id)
        assert data.startswith(expected(events[:3])) and f'"request_id": "{request_id}"'.encode() in data


def write_delays() -> tuple[float, float]:
    count = REGISTRY.get_sample_value("tandem_chat_stream_write_delay_seconds_count") or 0.0
    return count, REGISTRY.get_sample_value("tandem_chat_stream_write_delay_seconds_sum") or 0.0


async def test_a_live_passs_delay_from_the_tokens_production_is_measured_and_a_catch_ups_is_not():
    feed = new_feed()
    subscription = feed.subscribe(0, max_lag=8)
    count, total = write_delays()
    old = [TokenEvent(reply_id="r", seq=seq, text="x", produced_unix_ms=now_ms() - 60_000) for seq in (1, 2)]
    feed.deliver(old, is_caught_up=True)  # the catch-up: read from the log's past
    assert write_delays() == (count, total)
    feed.deliver([TokenEvent(reply_id="r", seq=3, text="y", produced_unix_ms=now_ms() - 500)], is_caught_up=True)
    new_count, new_total = write_delays()
    assert new_count == count + 1 and 0.5 <= new_total - total < 30.0
    assert subscription.num_queued == 1


class Connection(DirectWriter):
    """A DirectWriter over a byte buffer, which can refuse writes as a paused transport does."""

    def __init__(self) -> None:
        super().__init__(None, None)
        self.written = bytearray()
        self.refuses = False
        self.wrote = asyncio.Event()

    def write(self, chunk: bytes) -> bool:
        if self.refuses:
            return False
        self.written += chunk
        self.wrote.set()
        return True


def unframed(chunks: bytes) -> bytes:
    """A chunked body's data."""
    data, rest = b"", chunks
    while rest:
        size, rest = rest.split(b"\r\n", 1)
        data, rest = data + rest[: int(size, 16)], rest[int(size, 16) + 2 :]
    return data


async def test_live_events_are_written_to_a_waiting_connection_by_the_feed_and_the_final_by_its_task():
    feed = new_feed()
    connection = Connection()
    subscription = feed.subscribe(0, max_lag=8, last_sse_id=1, writer=connection)
    by_task = asyncio.create_task(taken(subscription))
    await asyncio.sleep(0)  # it waits at the feed's end
    for seq in range(1, 6):
        feed.deliver(tokens(seq, seq), is_caught_up=True)  # no await: its task never ran meanwhile
    assert unframed(bytes(connection.written)) == expected(tokens(1, 5))
    assert (subscription.cursor, subscription.last_sse_id) == (5, 6)
    final = final_event("r", 6, FINISH_REASON_STOP)
    feed.deliver([final], is_caught_up=True)
    feed.end(None)
    assert await by_task == expected([final])
    assert unframed(bytes(connection.written)) == expected(tokens(1, 5)), "the final event is its task's to write"


async def test_with_an_interval_live_events_go_out_together_at_its_end_and_a_final_one_at_once():
    interval_s = 0.2
    feed = Feed("r", "reader", lambda feed, error: feed.finish(error), interval_s=interval_s)
    connection = Connection()
    subscription = feed.subscribe(0, max_lag=8, last_sse_id=1, writer=connection)
    by_task = asyncio.create_task(taken(subscription))
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    feed.deliver(tokens(1, 1), is_caught_up=True)  # the first: at once
    first_s = loop.time()
    assert unframed(bytes(connection.written)) == expected(tokens(1, 1))
    connection.wrote.clear()
    feed.deliver(tokens(2, 2), is_caught_up=True)
    feed.deliver(tokens(3, 3), is_caught_up=True)
    assert unframed(bytes(connection.written)) == expected(tokens(1, 1)), "held for the interval"
    await asyncio.wait_for(connection.wrote.wait(), timeout=10)
    assert loop.time() - first_s >= interval_s * 0.9  # the loop's clock may round the timer
    assert bytes(connection.written).count(b"\r\n" + b"%x" % len(expected(tokens(2, 3)))) == 1, "both in one chunk"
    assert unframed(bytes(connection.written)) == expected(tokens(1, 3))
    feed.deliver(tokens(4, 4), is_caught_up=True)  # within the next interval: held
    final = final_event("r", 5, FINISH_REASON_STOP)
    feed.deliver([final], is_caught_up=True)  # the final one takes what was held with it, at once
    feed.end(None)
    assert await asyncio.wait_for(by_task, timeout=1) == expected([*tokens(4, 4), final])


async def test_a_connection_that_cannot_take_a_write_gets_the_events_from_its_task_in_order():
    feed = new_feed()
    connection = Connection()
    subscription = feed.subscribe(0, max_lag=8, last_sse_id=1, writer=connection)
    parts: list[bytes] = []

    async def task_writes() -> None:
        async for start, stop in subscription.ranges():
            parts.append(feed.sse_bytes(start, stop, subscription.last_sse_id, "req"))
            subscription.last_sse_id = feed.frames[stop - 1].each[-1][0]

    reader = asyncio.create_task(task_writes())
    await asyncio.sleep(0)
    feed.deliver(tokens(1, 2), is_caught_up=True)  # written by the feed
    connection.refuses = True
    feed.deliver(tokens(3, 3), is_caught_up=True)  # refused: the task is woken for it
    connection.refuses = False
    feed.deliver(tokens(4, 4), is_caught_up=True)  # the task has not taken seq 3 yet: not written ahead of it
    await asyncio.sleep(0)
    feed.deliver(tokens(5, 5), is_caught_up=True)  # waiting again: written by the feed
    feed.deliver([final_event("r", 6, FINISH_REASON_STOP)], is_caught_up=True)
    feed.end(None)
    await reader
    assert unframed(bytes(connection.written)) == expected(tokens(1, 2)) + expected(tokens(5, 5))
    assert b"".join(parts) == expected(tokens(3, 4)) + expected([final_event("r", 6, FINISH_REASON_STOP)])


async def test_a_subscriber_whose_client_is_ahead_of_the_log_is_not_written_events_it_has():
    """A Last-Event-ID past what the feed holds: the feed writes nothing up to it."""
    feed = new_feed()
    connection = Connection()
    subscription = feed.subscribe(after_seq=8, max_lag=8, last_sse_id=10, writer=connection)
    reader = asyncio.create_task(taken(subscription, after_id=10))
    await asyncio.sleep(0)
    feed.deliver(tokens(1, 3), is_caught_up=True)
    assert connection.written == b""
    feed.deliver([final_event("r", 4, FINISH_REASON_STOP)], is_caught_up=True)
    feed.end(None)
    assert await reader == b""


async def test_a_late_subscriber_gets_the_backlog_after_its_last_event_id_then_live():
    feed = new_feed()
    feed.deliver(tokens(1, 6), is_caught_up=True)
    late = feed.subscribe(after_seq=3, max_lag=2)  # Last-Event-ID 5: seq 4 is id 5
    reader = asyncio.create_task(taken(late, after_id=5))
    await asyncio.sleep(0)
    final = final_event("r", 7, FINISH_REASON_STOP)
    final.text = "end"  # a final event with text is two SSE events: delta 8, done 9
    feed.deliver([final], is_caught_up=True)
    feed.end(None)
    data = await reader
    assert data == expected([*tokens(5, 6), final], after_id=5)
    assert not late.is_dropped, "a backlog served from memory is nobody's queue"


async def test_a_resume_between_a_final_events_delta_and_done_gets_only_done():
    feed = new_feed()
    final = final_event("r", 3, FINISH_REASON_STOP)
    final.text = "end"
    feed.deliver([*tokens(1, 2), final], is_caught_up=True)
    feed.end(None)
    data = await taken(feed.subscribe(after_seq=2, max_lag=None), after_id=4)
    assert data.startswith(b"id: 5\r\nevent: done")
    assert data.count(b"event:") == 1


async def test_a_subscriber_that_stops_taking_is_dropped_and_the_others_get_everything():
    feed = new_feed()
    slow = feed.subscribe(0, max_lag=3)
    fast = feed.subscribe(0, max_lag=3)
    fast_reader = asyncio.create_task(taken(fast))
    for seq in range(1, 9):
        feed.deliver(tokens(seq, seq), is_caught_up=True)
        await asyncio.sleep(0)
    feed.deliver([final_event("r", 9, FINISH_REASON_STOP)], is_caught_up=True)
    feed.end(None)
    assert slow.is_dropped and not fast.is_dropped
    assert await taken(slow) == b"", "a dropped client's stream just ends; it resumes with Last-Event-ID"
    assert (await fast_reader).count(b"event: delta") == 8


async def test_a_catch_up_that_delivers_more_than_the_buffer_at_once_drops_nobody():
    feed = new_feed()
    first = feed.subscribe(0, max_lag=2)
    for start in (1, 11, 21):  # a long log read in batches before anyone could take any
        feed.deliver(tokens(start, start + 9), is_caught_up=start == 21)
    assert not first.is_dropped
    feed.deliver(tokens(31, 33), is_caught_up=True)  # then live, untaken: past the buffer
    assert first.is_dropped


async def test_a_feed_that_fails_raises_its_error_in_every_subscriber():
    feed = new_feed()
    subscriptions = [feed.subscribe(0, max_lag=None) for _ in range(3)]
    readers = [asyncio.create_task(taken(s)) for s in subscriptions]
    await asyncio.sleep(0)
    feed.end(ReplyGone("gone"))
    for reader in readers:
        with pytest.raises(ReplyGone):
            await reader


async def test_each_client_of_a_failed_reply_is_told_its_own_request_id_in_the_error():
    feed = new_feed()
    subscriptions = [feed.subscribe(0, max_lag=None) for _ in range(2)]
    readers = [asyncio.create_task(taken(s, request_id=f"req-{n}")) for n, s in enumerate(subscriptions)]
    await asyncio.sleep(0)
    failed = error_event("r", 3, "handoff_failed", "try again shortly", retry_after_s=2.0)
    feed.deliver([*tokens(1, 2), failed], is_caught_up=True)
    feed.end(None)
    late = await taken(feed.subscribe(0, max_lag=None), request_id="req-late")  # one attached after the end
    for data, request_id in zip([*await asyncio.gather(*readers), late], ["req-0", "req-1", "req-late"], strict=True):
        error = [block for block in data.split(b"\r\n\r\n") if b"event: error" in block]
        assert len(error) == 1 and error[0].startswith(b"id: 4\r\n"), data
        payload = json.loads(error[0].split(b"data: ", 1)[1])
        assert payload == {"code": "handoff_failed", "message": "try again shortly", "request_id": request_id, "retry_after": 2.0}
        assert data.count(b"event: delta") == 2


async def test_meta_is_encoded_as_the_response_would_write_it():
    assert meta_event("r", "m").encode() == b'id: 1\r\nevent: meta\r\ndata: {"message_id": "r", "model": "m", "dropped_turns": 0}\r\n\r\n'


FREE = ApiKey("u-free", Tier.FREE)
PRO = ApiKey("u-pro", Tier.PRO)


def test_a_user_past_their_tiers_limit_is_refused_with_too_many_streams():
    slots = StreamSlots(100, {Tier.FREE: 2, Tier.PLUS: 4, Tier.PRO: 50})
    held = [slots.admit(FREE) for _ in range(2)]
    with pytest.raises(RateLimited) as refused:
        slots.admit(FREE)
    assert refused.value.code == "too_many_streams" and refused.value.retry_after_s > 0
    slots.admit(PRO)  # another user is not limited by it
    held[0].release()
    held[0].release()  # a second release frees nothing more
    slots.admit(FREE)
    assert slots.num_open_of(FREE.user_id) == 2 and slots.num_open == 3


def test_a_stream_past_the_instances_capacity_is_refused_with_streams_full():
    slots = StreamSlots(3, {Tier.FREE: 2, Tier.PLUS: 4, Tier.PRO: 50})
    held = [slots.admit(PRO) for _ in range(3)]
    with pytest.raises(Unavailable) as refused:
        slots.admit(FREE)
    assert refused.value.code == "streams_full" and refused.value.retry_after_s > 0
    for slot in held:
        slot.release()
    assert slots.num_open == 0 and slots.num_open_of(PRO.user_id) == 0
    slots.admit(FREE)
