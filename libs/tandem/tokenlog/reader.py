"""Any edge's side of the token log: the logged events after N, then the live ones as they
land (blocking XREAD, no polling with sleeps), ending after the final event."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from redis.asyncio import Redis

from tandem.bus.events import is_final
from tandem.tokenlog.keys import ReplyKeys
from tandem.tokenlog.meta import load_reply
from tandem.tokenlog.values import as_bytes
from tandem.v1.tokens_pb2 import TokenEvent


class ReplyGone(LookupError):
    """The reply is unknown, or its log has expired."""


def entry_id(seq: int) -> str:
    return f"{seq}-1"


def _event_of(fields: Mapping[bytes | str, bytes | str] | None) -> TokenEvent:
    if not fields:
        raise ValueError("a token log entry without fields")
    return TokenEvent.FromString(as_bytes(fields[b"e"]))


async def read(redis: Redis, reply_id: str, *, after: int = 0, block_ms: int = 5000) -> AsyncIterator[TokenEvent]:
    """Events of one reply with seq > `after`, in order, ending after the final one.

    `redis` must allow a socket timeout longer than `block_ms`. Raises ReplyGone when the reply
    is not known or its log expires while waiting."""
    if after < 0:
        raise ValueError(f"after must be 0 or more; got {after}")
    keys = ReplyKeys(reply_id)
    last_id = entry_id(after) if after else "0-0"
    while True:
        response = await redis.xread({keys.log: last_id}, count=256, block=block_ms)
        if not response:
            meta = await load_reply(redis, reply_id)
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


async def logged_events(redis: Redis, reply_id: str, *, until: str = "+") -> list[TokenEvent]:
    """The events logged so far (up to the entry id `until`), at once (one range read, no waiting)."""
    entries = await redis.xrange(ReplyKeys(reply_id).log, max=until) or []
    return [_event_of(fields) for _, fields in entries]
