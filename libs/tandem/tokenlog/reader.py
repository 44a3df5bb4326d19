"""Any edge's side of the token log: the logged events after N, then the live ones as they
land (blocking XREAD, no polling with sleeps), ending after the final event. A Redis that
restarts under a reader costs the reader a pause: it retries with backoff, and only a Redis gone
for longer than a deadline ends the read, with LogUnavailable."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tandem.bus.events import is_final
from tandem.tokenlog.keys import ReplyKeys
from tandem.tokenlog.meta import load_reply
from tandem.tokenlog.values import as_bytes
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)
T = TypeVar("T")

UNAVAILABLE_DEADLINE_S = 30.0
_FIRST_RETRY_S = 0.1
_MAX_RETRY_S = 2.0


class ReplyGone(LookupError):
    """The reply is unknown, or its log has expired."""


class LogUnavailable(RedisConnectionError):
    """Redis did not answer for longer than the reader's deadline. A RedisError, so a caller that
    handles Redis failures already handles it."""


async def until_answered(call: Callable[[], Awaitable[T]], deadline_s: float) -> T:
    """`call()`, retried with backoff while Redis cannot be reached, for at most `deadline_s`."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + deadline_s
    delay_s = _FIRST_RETRY_S
    while True:
        try:
            return await call()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            if loop.time() + delay_s > give_up_at:
                raise LogUnavailable(f"the token log's Redis has not answered for {deadline_s:.0f} s ({exc})") from exc
            log.warning("token log unreachable (%s); retrying in %.1f s", exc, delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, _MAX_RETRY_S)


def entry_id(seq: int) -> str:
    return f"{seq}-1"


def _event_of(fields: Mapping[bytes | str, bytes | str] | None) -> TokenEvent:
    if not fields:
        raise ValueError("a token log entry without fields")
    return TokenEvent.FromString(as_bytes(fields[b"e"]))


async def read(
    redis: Redis, reply_id: str, *, after: int = 0, block_ms: int = 5000, unavailable_deadline_s: float = UNAVAILABLE_DEADLINE_S
) -> AsyncIterator[TokenEvent]:
    """Events of one reply with seq > `after`, in order, ending after the final one.

    `redis` must allow a socket timeout longer than `block_ms`. Raises ReplyGone when the reply
    is not known or its log expires while waiting, LogUnavailable when Redis cannot be reached for
    `unavailable_deadline_s` (each answer starts the deadline again)."""
    if after < 0:
        raise ValueError(f"after must be 0 or more; got {after}")
    keys = ReplyKeys(reply_id)
    last_id = entry_id(after) if after else "0-0"
    while True:
        response = await until_answered(partial(redis.xread, {keys.log: last_id}, count=256, block=block_ms), unavailable_deadline_s)
        if not response:
            meta = await until_answered(partial(load_reply, redis, reply_id), unavailable_deadline_s)
            if meta is None:
                raise ReplyGone(f"reply {reply_id} is unknown or its log has expired")
            if not meta.is_running and meta.last_seq <= after:
                return  # asked for what follows the final event: nothing
            continue
        if not isinstance(response, list):
            raise TypeError("the token log reads Redis over RESP2 (redis-py's default protocol)")
        for _, entries in response:  # one stream: [[name, [(entry id, fields), ...]]]
            for item_id, fields in entries:
                event = _event_of(fields)
                yield event
                if is_final(event):
                    return
                last_id = item_id


async def logged_events(redis: Redis, reply_id: str, *, since: str = "-", until: str = "+") -> list[TokenEvent]:
    """The events logged so far (from the entry id `since` up to `until`), at once (one range read, no waiting)."""
    entries = await redis.xrange(ReplyKeys(reply_id).log, min=since, max=until) or []
    return [_event_of(fields) for _, fields in entries]
