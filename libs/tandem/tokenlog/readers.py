"""Who is reading a reply: each streaming client holds a lease it renews while attached, so a
chat instance that dies stops counting once its leases run out. The relay cancels a reply that
nobody has read for a while."""

from __future__ import annotations

from redis.asyncio import Redis

from tandem.bus.events import now_ms
from tandem.tokenlog.keys import READERS_TTL_S, ReplyKeys


async def attach(redis: Redis, reply_id: str, reader_id: str, lease_s: float) -> None:
    """Takes or renews a reader's lease."""
    readers = ReplyKeys(reply_id).readers
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zadd(readers, {reader_id: now_ms() + int(lease_s * 1000)})
        pipe.expire(readers, max(READERS_TTL_S, int(lease_s) + 1))
        await pipe.execute()


# Only touches a reply still recorded: a detach after the log expired must not leave a key behind.
_NOTE_DETACH = """
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'last_reader_ms', ARGV[2]) end
"""


async def detach(redis: Redis, reply_id: str, reader_id: str) -> None:
    keys = ReplyKeys(reply_id)
    await redis.eval(_NOTE_DETACH, 2, keys.meta, keys.readers, reader_id, now_ms())


async def idle_for_ms(redis: Redis, reply_id: str) -> int:
    """How long nobody has read the reply; 0 while someone holds a live lease."""
    keys = ReplyKeys(reply_id)
    now = now_ms()
    latest = await redis.zrevrange(keys.readers, 0, 0, withscores=True)
    latest_expiry_ms = int(latest[0][1]) if latest else 0
    if latest_expiry_ms > now:
        return 0
    last_reader_ms = int(await redis.hget(keys.meta, "last_reader_ms") or 0)
    return max(0, now - max(latest_expiry_ms, last_reader_ms))
