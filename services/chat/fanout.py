"""One read of a reply's token log per chat instance, fanned out in process.

The first client attached to a reply starts its Feed: the log read once from its start (by the
multiplexed tandem.tokenlog.LogTail), every event kept in memory (a reply is bounded by its max
tokens) with its SSE bytes encoded once, and one reader lease on the reply for the instance.
Every client of the reply is a Subscription: a cursor into the feed's events, woken when more
land; a late one starts from its Last-Event-ID, from memory. A client more than `max_lag` live
events behind is dropped (its stream ends, it resumes with Last-Event-ID) and nobody else waits
for it. A feed stops reading when its last client leaves, and after the final event.

A subscriber that waits at the feed's end with a DirectWriter (an SSE stream on uvicorn) is
written its new events by the feed itself, framed once for all of them (services.chat.direct_write):
its task is woken only for what it must write itself (the final event, an error, a late start).
With TANDEM_STREAM_INTERVAL_MS, live events are passed on at most once an interval, so a write
to a client carries several (the cost per stream is a write, not an event)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.chat import metrics
from services.chat.config import ChatConfig
from services.chat.direct_write import DirectWriter
from services.chat.sse import Frames, encode_frames
from tandem.bus.events import is_final, now_ms
from tandem.tokenlog import LogTail, ReplyMeta, TailConfig, attach, detach
from tandem.tokenlog.keys import READERS_TTL_S, ReplyKeys
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)


class Feed:
    """One reply's events on this instance, read once, for every subscriber. A TailSink."""

    def __init__(
        self, reply_id: str, reader_id: str, on_read_end: Callable[[Feed, Exception | None], None], interval_s: float = 0.0
    ) -> None:
        self.reply_id = reply_id
        self.reader_id = reader_id  # its reader lease
        self.events: list[TokenEvent] = []
        self.frames: list[Frames] = []  # each event's SSE events, encoded once
        self.num_backlog = 0  # events read while catching up: nobody's queue, whoever joined when
        self.is_reading = True  # following the log (and holding a lease)
        self.is_finished = False  # no event will come: subscribers end after what they have
        self.error: Exception | None = None  # why it finished, if not at its end
        self.is_closed = False  # its last subscriber left
        self.meta: ReplyMeta | None = None  # the reply's meta as a subscriber read it (owner, model, route)
        self._is_live = False
        self._prefix, self._prefix_stop = b"", 0  # the bytes of events[0:_prefix_stop], for clients from the start
        self._once: asyncio.Future[None] | None = None
        self._on_read_end = on_read_end
        self._subscribers: set[Subscription] = set()
        # Live events are passed on to subscribers at most once an interval (the first, a final
        # one and a catch-up's at once): each write to a client then carries more of them.
        self._interval_s = interval_s
        self._num_passed = 0
        self._passed_at_s = -math.inf
        self._pass_timer: asyncio.TimerHandle | None = None

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def text(self) -> str:
        return "".join(event.text for event in self.events)

    async def once(self, work: Callable[[], Awaitable[None]]) -> None:
        """`work()` run once for the feed however many subscribers ask; each waits for it."""
        if self._once is None:
            self._once = asyncio.ensure_future(work())
        await asyncio.shield(self._once)

    def subscribe(self, after_seq: int, max_lag: int | None, last_sse_id: int = 0, writer: DirectWriter | None = None) -> Subscription:
        subscription = Subscription(
            self, cursor=min(after_seq, len(self.events)), after_seq=after_seq, max_lag=max_lag, last_sse_id=last_sse_id, writer=writer
        )
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def deliver(self, events: Sequence[TokenEvent], is_caught_up: bool) -> None:
        was_live = self._is_live
        self.events.extend(events)
        self.frames.extend(encode_frames(event) for event in events)
        if not self._is_live:  # the catch-up, up to its first read that reached the log's end
            self.num_backlog = len(self.events)
            self._is_live = is_caught_up
        now_s = asyncio.get_running_loop().time()
        due_s = self._passed_at_s + self._interval_s
        if not was_live or is_final(events[-1]) or now_s >= due_s:
            self._pass_on(now_s)
        elif self._pass_timer is None:  # within the interval: these go with the next events, or at its end
            self._pass_timer = asyncio.get_running_loop().call_at(due_s, self._pass_on_due)

    def _pass_on_due(self) -> None:
        self._pass_timer = None
        self._pass_on(asyncio.get_running_loop().time())

    def _pass_on(self, now_s: float) -> None:
        """The events not yet passed on, to every subscriber: written by the feed to those waiting
        at its end with a writer, one framed chunk for them all; the others' tasks woken."""
        if self._pass_timer is not None:
            self._pass_timer.cancel()
            self._pass_timer = None
        start, stop = self._num_passed, len(self.events)
        if start == stop:
            return
        self._num_passed, self._passed_at_s = stop, now_s
        started_s = time.perf_counter()
        frames = self.frames[start:stop]
        # A final event ends each response (its task writes it); an error names each request.
        can_write = not is_final(self.events[stop - 1]) and not any(f.is_per_request for f in frames)
        chunk = b""  # the events' bytes as a response chunk, framed once for every writer
        first_id, last_id = frames[0].first_id, frames[-1].each[-1][0]
        num_written = 0
        for subscription in self._subscribers:  # thousands: what is the same for all is hoisted
            if can_write and subscription.is_waiting_at(start, first_id):
                chunk = chunk or DirectWriter.frame(b"".join(f.blob for f in frames))
                if subscription.write(chunk, stop, last_id):
                    num_written += 1
                    continue
            subscription.on_more()
        if num_written:
            metrics.STREAM_DIRECT_WRITES.inc(num_written)
        metrics.STREAM_PASS_SECONDS.observe(time.perf_counter() - started_s)
        produced_ms = self.events[start].produced_unix_ms
        if produced_ms and start >= self.num_backlog:  # a live event, not one read from the log's past
            metrics.STREAM_WRITE_DELAY.observe(max(0.0, time.time() - produced_ms / 1000))

    def end(self, error: Exception | None) -> None:
        """The tail's word that reading is over (the final event read, or the log gone)."""
        self.is_reading = False
        self._on_read_end(self, error)

    def drop_resumable(self) -> None:
        """Ends every stream whose client can resume it (Last-Event-ID) after what it has."""
        for subscription in self._subscribers:
            if subscription.max_lag is not None:
                subscription.drop()

    def finish(self, error: Exception | None) -> None:
        if self._pass_timer is not None:  # every subscriber is woken for the rest
            self._pass_timer.cancel()
            self._pass_timer = None
        self.is_finished = True
        self.error = error
        for subscription in self._subscribers:
            subscription.wake()

    def sse_bytes(self, start: int, stop: int, after_id: int, request_id: str) -> bytes:
        """The SSE bytes of events[start:stop], leaving out any SSE id up to `after_id`; an error
        event names `request_id`, the request they are written to (encoded for it, not shared)."""
        if start == 0 and stop > 0 and self.frames[0].first_id > after_id:
            prefix = self._prefix_bytes(stop)
            if prefix is not None:
                return prefix
        parts: list[bytes] = []
        for index in range(start, stop):
            frames = self.frames[index]
            if frames.is_per_request:
                frames = encode_frames(self.events[index], request_id)
            if frames.first_id > after_id:
                parts.append(frames.blob)
            else:
                parts.extend(data for sse_id, data in frames.each if sse_id > after_id)
        return b"".join(parts)

    def _prefix_bytes(self, stop: int) -> bytes | None:
        """The SSE bytes of events[0:stop], one object for every client that joins at the start
        (each would otherwise join the same hundreds of frames); None when they hold an event
        encoded per request, or the prefix kept is already longer."""
        if self._prefix_stop < stop:
            frames = self.frames[self._prefix_stop : stop]
            if any(f.is_per_request for f in frames):
                return None
            self._prefix += b"".join(f.blob for f in frames)
            self._prefix_stop = stop
        return self._prefix if self._prefix_stop == stop else None


class Subscription:
    """One client's place in a feed: events [cursor, len) are queued for it; `last_sse_id`, the
    last SSE id its client was written."""

    # A feed's pass reads these for each of thousands of subscribers: slots are quicker to read.
    __slots__ = ("_is_waiting", "_wake", "_writer", "after_seq", "cursor", "feed", "is_dropped", "last_sse_id", "live_from", "max_lag")

    def __init__(
        self, feed: Feed, *, cursor: int, after_seq: int, max_lag: int | None, last_sse_id: int = 0, writer: DirectWriter | None = None
    ) -> None:
        self.feed = feed
        self.cursor = cursor
        self.live_from = max(len(feed.events), feed.num_backlog)  # what it joined to is backlog, not queue
        self.after_seq = after_seq
        self.max_lag = max_lag
        self.last_sse_id = last_sse_id
        self.is_dropped = False
        self._writer = writer
        self._is_waiting = False  # its task waits in ranges(), having written everything before `cursor`
        self._wake = asyncio.Event()

    def is_waiting_at(self, cursor: int, first_id: int) -> bool:
        """Whether the feed can write it events from `cursor` on (SSE ids from `first_id`) itself."""
        return (
            self._is_waiting and self._writer is not None and self.cursor == cursor and first_id > self.last_sse_id and not self.is_dropped
        )

    def write(self, chunk: bytes, stop: int, last_sse_id: int) -> bool:
        """`chunk` (events [cursor, stop), framed) written to the client by the feed; False when
        its writer cannot take it now (its task then writes them)."""
        if self._writer is None or not self._writer.write(chunk):
            return False
        self.cursor, self.last_sse_id = stop, last_sse_id
        return True

    @property
    def num_queued(self) -> int:
        """Live events delivered to the feed that this client has not taken yet."""
        return len(self.feed.events) - max(self.cursor, self.live_from, self.feed.num_backlog)

    def on_more(self) -> None:
        if self.max_lag is not None and not self.is_dropped and self.num_queued > self.max_lag:
            self.is_dropped = True
            metrics.STREAMS_DROPPED.inc()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def drop(self) -> None:
        self.is_dropped = True
        self._wake.set()

    async def ranges(self) -> AsyncIterator[tuple[int, int]]:
        """[start, stop) of the feed's events, all there is each time, until the feed finishes
        (raising its error, ReplyGone or LogUnavailable) or this client is dropped (it just ends)."""
        while True:
            if self.is_dropped:
                return
            stop = len(self.feed.events)
            if self.cursor < stop:
                start, self.cursor = self.cursor, stop
                yield start, stop
                continue
            if self.feed.is_finished:
                if self.feed.error is not None:
                    raise copy.copy(self.feed.error)  # each subscriber its own, so no traceback grows shared
                return
            self._wake.clear()
            self._is_waiting = True
            try:
                await self._wake.wait()
            finally:
                self._is_waiting = False

    async def events(self) -> AsyncIterator[TokenEvent]:
        async for start, stop in self.ranges():
            for event in self.feed.events[start:stop]:
                yield event


class FanoutHub:
    """Every feed of this instance, their reader leases (renewed together) and the log tail."""

    def __init__(self, tail: LogTail, redis: Redis, instance_id: str, lease_s: float, interval_s: float = 0.0) -> None:
        self._tail = tail
        self._redis = redis
        self._instance_id = instance_id
        self._lease_s = lease_s
        self._interval_s = interval_s  # each feed's, between passing live events on
        self._feeds: dict[str, Feed] = {}
        self._lease_lock = asyncio.Lock()  # a renewal never lands after a detach
        self._renewer: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.is_draining = False
        metrics.READER_CONNECTIONS.set_function(lambda: tail.num_connections)

    def drain(self) -> None:
        """This instance is stopping: every stream a client can resume ends now, and each one
        that subscribes from now on right away, so their clients resume on another instance
        (streams that cannot resume, the OpenAI endpoints', go on while the server waits)."""
        self.is_draining = True
        for feed in self._feeds.values():
            feed.drop_resumable()

    @property
    def num_feeds(self) -> int:
        return len(self._feeds)

    def running_meta(self, reply_id: str) -> ReplyMeta | None:
        """The meta of a reply this instance's feed is reading now, as its first client read it
        (who owns it, its conversation, model and route: fixed for a reply's life); None when no
        feed reads it, or it has read the final event. A client attaching to a reply others here
        already stream then costs no Redis read."""
        feed = self._feeds.get(reply_id)
        if feed is None or feed.meta is None or not feed.is_reading or feed.is_finished:
            return None
        return feed.meta

    @property
    def num_reader_connections(self) -> int:
        return self._tail.num_connections

    @contextlib.asynccontextmanager
    async def subscribe(
        self,
        reply_id: str,
        *,
        after_seq: int = 0,
        max_lag: int | None = None,
        last_sse_id: int = 0,
        writer: DirectWriter | None = None,
        meta: ReplyMeta | None = None,
    ) -> AsyncIterator[Subscription]:
        """A place in the reply's feed (started if this instance has none) from seq > `after_seq`,
        its client written up to SSE id `last_sse_id`; `writer`: the feed may write it live events;
        `meta`: the reply's, as the caller read it (kept for running_meta)."""
        feed = self._feeds.get(reply_id)
        is_new = feed is None
        if feed is None:
            feed = Feed(reply_id, f"{self._instance_id}:{uuid.uuid4().hex[:8]}", self._read_ended, self._interval_s)
            self._feeds[reply_id] = feed
            metrics.FEEDS_ACTIVE.set(len(self._feeds))
        if feed.meta is None and meta is not None and meta.reply_id == reply_id:
            feed.meta = meta
        subscription = feed.subscribe(after_seq, max_lag, last_sse_id, writer)
        if self.is_draining and max_lag is not None:
            subscription.drop()
        try:
            if is_new:
                await self._start(feed)
            yield subscription
        finally:
            feed.unsubscribe(subscription)
            if feed.num_subscribers == 0:
                self._close(feed)

    async def _start(self, feed: Feed) -> None:
        try:
            async with self._lease_lock:  # before any detach of it
                await attach(self._redis, feed.reply_id, feed.reader_id, self._lease_s)
            if not feed.is_closed:
                await self._tail.follow(feed.reply_id, feed)
        except RedisError as exc:
            feed.end(exc)
            return
        if feed.is_closed:  # everyone left while it started
            self._tail.unfollow(feed.reply_id)
        elif self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_leases(), name="reader-leases")

    def _close(self, feed: Feed) -> None:
        """Its last subscriber left: it reads for nobody."""
        feed.is_closed = True
        if self._feeds.get(feed.reply_id) is feed:
            del self._feeds[feed.reply_id]
            metrics.FEEDS_ACTIVE.set(len(self._feeds))
        if feed.is_reading:
            self._tail.unfollow(feed.reply_id)
            feed.is_reading = False
            self._spawn(self._detach(feed))

    def _read_ended(self, feed: Feed, error: Exception | None) -> None:
        """The tail is done with the feed: its lease goes, and a feed that failed is no longer
        joined (a new client starts a fresh one)."""
        if error is None:
            feed.finish(None)
            self._spawn(self._detach(feed))
            return
        if self._feeds.get(feed.reply_id) is feed:
            del self._feeds[feed.reply_id]
            metrics.FEEDS_ACTIVE.set(len(self._feeds))
        self._spawn(self._detach_then_finish(feed, error))

    async def _detach_then_finish(self, feed: Feed, error: Exception) -> None:
        """A failed feed's subscribers hear of it once its lease is gone: nothing of a vanished
        reply is left behind when they do."""
        try:
            await self._detach(feed)
        finally:
            feed.finish(error)

    async def _detach(self, feed: Feed) -> None:
        async with self._lease_lock:
            try:
                await detach(self._redis, feed.reply_id, feed.reader_id)
            except RedisError as exc:  # the lease runs out by itself
                log.warning("reply %s: reader lease not released: %s", feed.reply_id, exc)

    async def _renew_leases(self) -> None:
        """Every reading feed's lease, renewed in one pipeline a third of a lease apart; ends when none reads."""
        try:
            while any(feed.is_reading for feed in self._feeds.values()):
                await asyncio.sleep(self._lease_s / 3)
                async with self._lease_lock:
                    reading = [feed for feed in self._feeds.values() if feed.is_reading]
                    if reading:
                        await self._renew(reading)
        finally:
            self._renewer = None

    async def _renew(self, feeds: list[Feed]) -> None:
        expiry_ms = now_ms() + int(self._lease_s * 1000)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for feed in feeds:
                    readers = ReplyKeys(feed.reply_id).readers
                    pipe.zadd(readers, {feed.reader_id: expiry_ms})
                    pipe.expire(readers, max(READERS_TTL_S, int(self._lease_s) + 1))
                await pipe.execute()
        except RedisError as exc:  # the next round tries again; a lease outlives two misses
            log.warning("reader leases not renewed: %s", exc)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for feed in list(self._feeds.values()):
            feed.finish(None)
        if self._renewer is not None:
            self._renewer.cancel()
        await self._tail.close()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def open_fanout(config: ChatConfig, redis_url: str, redis: Redis, instance_id: str) -> FanoutHub:
    """The hub of a chat instance: `config.stream_readers` reader connections of its own to
    `redis_url`; `redis` (the short-command client) for leases and waking readers."""
    tail = LogTail(TailConfig(redis_url, num_readers=config.stream_readers, name=f"{instance_id}:{uuid.uuid4().hex[:6]}"), redis)
    return FanoutHub(tail, redis, instance_id, config.reader_lease_s, config.stream_interval_ms / 1000)
