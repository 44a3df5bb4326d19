"""Many replies' token logs read live over a few Redis connections: each reader loop holds one
connection and blocks in one XREAD over every log it follows, so an edge serving thousands of
streams holds a handful of reads, not one each. A log joins a loop that is blocked through the
loop's own wake stream (cancelling a read would drop its connection), read from where it asks,
and leaves it after its final event.

What `read` promises one reply, this promises each followed one: a log that vanishes ends it
with ReplyGone; a Redis that restarts costs a pause (retries with backoff); a Redis gone for
longer than the deadline ends every log of the loop with LogUnavailable. A log entry that cannot
be read ends its reply with ReplyGone; anything else the loop did not expect (a reply's key of
another type, a bug) is logged and ends every log of the loop with LogUnavailable: its readers get
an error to act on (a client resumes), never a wait without end."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

from google.protobuf.message import DecodeError
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tandem.bus.events import is_final
from tandem.redis_sentinel import reader_like
from tandem.tokenlog.keys import ReplyKeys
from tandem.tokenlog.meta import load_reply_states
from tandem.tokenlog.reader import UNAVAILABLE_DEADLINE_S, LogUnavailable, ReplyGone, entry_id
from tandem.tokenlog.values import as_bytes, as_text
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)

WAKE_TTL_S = 3600  # a loop's wake stream; every XADD pushes it back
_WAKE_MAXLEN = 16
_FIRST_RETRY_S = 0.1
_MAX_RETRY_S = 2.0
_ENTRIES_PER_READ = 256
CLOSE_WAIT_S = 5.0  # close() waits this long for a loop's task; with nothing followed it ends after its read anyway


class TailSink(Protocol):
    """Where one followed log's events go; called on the loop's task, so it must not block."""

    def deliver(self, events: Sequence[TokenEvent], is_caught_up: bool) -> None:
        """`events` in order; `is_caught_up`: they reach what the log held when read (a catch-up's
        earlier batches are False)."""

    def end(self, error: Exception | None) -> None:
        """No more events: after the final one (or a log closed without one: None), or ReplyGone /
        LogUnavailable."""


@dataclass(eq=False)
class _Follow:
    reply_id: str
    sink: TailSink
    last_id: bytes  # the entry id read last
    last_seq: int
    quiet_since_s: float  # loop time of the last event (or the join)


@dataclass(frozen=True)
class TailConfig:
    redis_url: str
    num_readers: int = 4
    block_ms: int = 5000  # also how often a quiet log is checked for having vanished
    unavailable_deadline_s: float = UNAVAILABLE_DEADLINE_S
    name: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # names the wake streams


class LogTail:
    """Follows logs on `num_readers` loops; `wake_redis` (a short-command client) wakes a blocked loop."""

    def __init__(self, config: TailConfig, wake_redis: Redis) -> None:
        self._loops = [_ReaderLoop(config, wake_redis, index) for index in range(config.num_readers)]

    async def follow(self, reply_id: str, sink: TailSink, *, after: int = 0) -> None:
        """Starts delivering the events of `reply_id` with seq > `after` to `sink`, on the loop
        that follows fewest logs."""
        if any(loop.has(reply_id) for loop in self._loops):
            raise ValueError(f"reply {reply_id} is followed already")
        loop = min(self._loops, key=lambda each: each.num_follows)
        await loop.add(_Follow(reply_id, sink, entry_id(after).encode() if after else b"0-0", after, 0.0))

    def unfollow(self, reply_id: str) -> None:
        """Stops delivering; no call reaches its sink after this (no read is needed to leave)."""
        for loop in self._loops:
            loop.remove(reply_id)

    @property
    def num_connections(self) -> int:
        return sum(loop.is_connected for loop in self._loops)

    async def close(self) -> None:
        for loop in self._loops:
            await loop.close()


class _ReaderLoop:
    """One connection, one blocking XREAD over its logs plus its wake stream; runs while it follows any."""

    def __init__(self, config: TailConfig, wake_redis: Redis, index: int) -> None:
        self._config = config
        self._wake_redis = wake_redis
        self._wake_key = f"tandem:tail:{config.name}:{index}:wake"
        self._wake_last_id = b"0-0"
        self._follows: dict[str, _Follow] = {}
        self._joining: dict[str, _Follow] = {}
        self._is_reading = False  # blocked in XREAD: a join must wake it
        self._is_wake_sent = False
        self._task: asyncio.Task[None] | None = None
        self._redis: Redis | None = None

    @property
    def num_follows(self) -> int:
        return len(self._follows) + len(self._joining)

    @property
    def is_connected(self) -> bool:
        return self._redis is not None

    def has(self, reply_id: str) -> bool:
        return reply_id in self._follows or reply_id in self._joining

    async def add(self, follow: _Follow) -> None:
        self._joining[follow.reply_id] = follow
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"tail:{self._wake_key}")
        elif self._is_reading and not self._is_wake_sent:
            self._is_wake_sent = True
            try:
                async with self._wake_redis.pipeline(transaction=False) as pipe:
                    pipe.xadd(self._wake_key, {"w": "1"}, maxlen=_WAKE_MAXLEN, approximate=False)
                    pipe.expire(self._wake_key, WAKE_TTL_S)
                    await pipe.execute()
            except RedisError as exc:  # the blocked read ends by itself within block_ms
                log.warning("could not wake token log reader %s: %s", self._wake_key, exc)

    def remove(self, reply_id: str) -> None:
        self._follows.pop(reply_id, None)
        self._joining.pop(reply_id, None)

    async def close(self) -> None:
        """Stops following; the loop's task ends (cancelled, or at the end of its read at the latest)."""
        self._follows.clear()
        self._joining.clear()
        task = self._task
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=CLOSE_WAIT_S)

    async def _run(self) -> None:
        # Where the wake client goes (the primary its sentinels name, or redis_url), with its login.
        redis = reader_like(self._wake_redis, self._config.redis_url, socket_timeout_s=self._config.block_ms / 1000 + 10)
        self._redis = redis
        loop = asyncio.get_running_loop()
        failing_since_s: float | None = None
        delay_s = _FIRST_RETRY_S
        try:
            while self._follows or self._joining:
                try:
                    await self._step(redis, loop.time())
                    failing_since_s, delay_s = None, _FIRST_RETRY_S
                except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                    failing_since_s = failing_since_s if failing_since_s is not None else loop.time()
                    if loop.time() + delay_s - failing_since_s > self._config.unavailable_deadline_s:
                        gone = LogUnavailable(
                            f"the token log's Redis has not answered for {self._config.unavailable_deadline_s:.0f} s ({exc})"
                        )
                        self._end_all(gone)
                        failing_since_s = None
                        continue
                    log.warning("token log unreachable (%s); retrying in %.1f s", exc, delay_s)
                    await asyncio.sleep(delay_s)
                    delay_s = min(delay_s * 2, _MAX_RETRY_S)
                except Exception as exc:  # the loop's followers must hear of it: nothing else would wake them
                    log.exception("token log reader %s failed; ending the %d logs it read", self._wake_key, self.num_follows)
                    self._end_all(LogUnavailable(f"the token log could not be read ({type(exc).__name__}: {exc})"))
        finally:
            self._task = None  # set before any await: a follow added from now on starts a new run
            self._redis = None
            self._is_reading = self._is_wake_sent = False
            await redis.aclose()

    async def _step(self, redis: Redis, now_s: float) -> None:
        """Joins whoever waits to, reads once (blocking), then checks quiet logs for having vanished."""
        await self._join(redis, now_s)
        if not self._follows:
            return
        by_key = {ReplyKeys(f.reply_id).log: f for f in self._follows.values()}
        streams: dict[str, bytes] = {key: f.last_id for key, f in by_key.items()}
        streams[self._wake_key] = self._wake_last_id
        self._is_reading, self._is_wake_sent = True, False
        if self._joining:  # added while this step joined the others: join it before blocking (nothing woke us for it)
            self._is_reading = False
            return
        try:
            response = await redis.xread(streams, count=_ENTRIES_PER_READ, block=self._config.block_ms)  # type: ignore[arg-type]
        finally:
            self._is_reading = False
        if response and not isinstance(response, list):
            raise TypeError("the token log reads Redis over RESP2 (redis-py's default protocol)")
        now_s = asyncio.get_running_loop().time()
        answered = cast("list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]", response or [])
        for key, entries in answered:  # [[name, [(entry id, fields), ...]], ...]
            if as_text(key) == self._wake_key:
                self._wake_last_id = as_bytes(entries[-1][0])
                continue
            follow = by_key[as_text(key)]
            if self._follows.get(follow.reply_id) is follow:  # not left meanwhile
                self._deliver(follow, entries, now_s)
        quiet = [f for f in self._follows.values() if now_s - f.quiet_since_s >= self._config.block_ms / 1000]
        await self._check(redis, quiet, now_s)

    async def _join(self, redis: Redis, now_s: float) -> None:
        """Whoever waits to join: a log unknown from the start ends at once with ReplyGone."""
        joining = list(self._joining.values())
        self._joining.clear()
        for follow in joining:
            follow.quiet_since_s = now_s
            self._follows[follow.reply_id] = follow
        await self._check(redis, joining, now_s)

    async def _check(self, redis: Redis, follows: list[_Follow], now_s: float) -> None:
        """A log whose reply is gone ends with ReplyGone; one closed with nothing left to read ends."""
        if not follows:
            return
        states = await load_reply_states(redis, [f.reply_id for f in follows])
        for follow in follows:
            if self._follows.get(follow.reply_id) is not follow:
                continue
            meta = states[follow.reply_id]
            if meta is None:
                self._end(follow, ReplyGone(f"reply {follow.reply_id} is unknown or its log has expired"))
            elif not meta.is_running and meta.last_seq <= follow.last_seq:
                self._end(follow, None)  # asked for what follows the final event: nothing
            else:
                follow.quiet_since_s = now_s

    def _deliver(self, follow: _Follow, entries: list[tuple[bytes, dict[bytes, bytes]]], now_s: float) -> None:
        events: list[TokenEvent] = []
        is_caught_up = len(entries) < _ENTRIES_PER_READ
        unreadable: ReplyGone | None = None
        for item_id, fields in entries:
            try:
                events.append(TokenEvent.FromString(as_bytes(fields[b"e"])))
            except (KeyError, DecodeError) as exc:  # not what a writer appends: the log cannot be followed past it
                log.error("reply %s: token log entry %r cannot be read (%s: %s)", follow.reply_id, item_id, type(exc).__name__, exc)
                unreadable = ReplyGone(f"reply {follow.reply_id}'s token log holds an entry that cannot be read")
                break
            follow.last_id = as_bytes(item_id)
            if is_final(events[-1]):
                break
        if events:
            follow.last_seq = events[-1].seq
            follow.quiet_since_s = now_s
            try:
                follow.sink.deliver(events, is_caught_up and unreadable is None)
            except Exception as exc:  # one sink's fault must not stop the loop every other log is read on
                log.exception("a sink of reply %s failed", follow.reply_id)
                self._end(follow, exc)
                return
        if unreadable is not None:
            self._end(follow, unreadable)
        elif events and is_final(events[-1]):
            self._end(follow, None)

    def _end(self, follow: _Follow, error: Exception | None) -> None:
        self.remove(follow.reply_id)
        try:
            follow.sink.end(error)
        except Exception:
            log.exception("a sink of reply %s failed to end", follow.reply_id)

    def _end_all(self, error: Exception) -> None:
        for follow in [*self._follows.values(), *self._joining.values()]:
            self._end(follow, error)
