"""Taking a running reply from its owner: the relay does it when the reply's worker is lost.
One atomic step bumps the reply's owner epoch (so the log drops whatever the old owner still
sends), forgets the events the old owner had sent ahead of a gap, and says how far the log got;
the tokens logged up to there are what the next owner continues after.

A guard (the epoch and last seq the caller saw) makes the step happen once when several relays
see the same stall at once: the others find the epoch moved and leave the reply alone."""

from __future__ import annotations

from typing import NamedTuple

from redis.asyncio import Redis

from tandem.bus.events import now_ms
from tandem.tokenlog.keys import RUNNING_REPLY_TTL_S, ReplyKeys
from tandem.tokenlog.reader import entry_id, logged_events

# KEYS: log, pending, meta. ARGV: now_ms, expected epoch ('' any), expected last seq ('' any),
# running ttl_s, continuations to add (1 for a continuation, 0 to fence the reply off and end it).
# Returns {new epoch, last seq}, or {-1, 0} when the reply is not running, {-2, 0} when the guard fails.
_TAKE_OVER = """
if redis.call('HGET', KEYS[3], 'status') ~= 'running' or redis.call('HEXISTS', KEYS[3], 'final_seq') == 1 then
  return {-1, 0}
end
local epoch = tonumber(redis.call('HGET', KEYS[3], 'epoch') or '0')
local last = tonumber(redis.call('HGET', KEYS[3], 'last_seq') or '0')
if (ARGV[2] ~= '' and tonumber(ARGV[2]) ~= epoch) or (ARGV[3] ~= '' and tonumber(ARGV[3]) ~= last) then
  return {-2, 0}
end
epoch = epoch + 1
redis.call('HSET', KEYS[3], 'epoch', epoch, 'continued_ms', ARGV[1])
redis.call('HINCRBY', KEYS[3], 'continuations', tonumber(ARGV[5]))
redis.call('HDEL', KEYS[3], 'gap_since_ms')
redis.call('DEL', KEYS[2])
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return {epoch, last}
"""


class Continuation(NamedTuple):
    epoch: int  # the new owner's epoch
    token_ids: list[int]  # the tokens logged, seq 1..last: the new owner generates after them


class TakenOver(NamedTuple):
    epoch: int
    last_seq: int


async def _take_over(
    redis: Redis, reply_id: str, num_added: int, expected_epoch: int | None, expected_last_seq: int | None, ttl_s: int
) -> TakenOver | None:
    keys = ReplyKeys(reply_id)
    guard = ["" if expected_epoch is None else expected_epoch, "" if expected_last_seq is None else expected_last_seq]
    epoch, last_seq = await redis.eval(_TAKE_OVER, 3, keys.log, keys.pending, keys.meta, now_ms(), *guard, ttl_s, num_added)
    return TakenOver(int(epoch), int(last_seq)) if int(epoch) >= 0 else None


async def begin_continuation(
    redis: Redis,
    reply_id: str,
    *,
    expected_epoch: int | None = None,
    expected_last_seq: int | None = None,
    ttl_s: int = RUNNING_REPLY_TTL_S,
) -> Continuation | None:
    """Makes the reply's next owner epoch, records the continuation (`continued_ms`, one more
    `continuations`) and returns the new epoch with the token ids logged so far. None when the
    reply is no longer running, or its epoch or last seq is no longer what the caller expected."""
    taken = await _take_over(redis, reply_id, 1, expected_epoch, expected_last_seq, ttl_s)
    if taken is None:
        return None
    # Entries up to last_seq never change once logged, so this range is exactly seq 1..last.
    events = await logged_events(redis, reply_id, until=entry_id(taken.last_seq)) if taken.last_seq else []
    return Continuation(taken.epoch, [event.token_id for event in events])


async def fence_reply(
    redis: Redis, reply_id: str, *, expected_epoch: int | None = None, ttl_s: int = RUNNING_REPLY_TTL_S
) -> TakenOver | None:
    """Takes the reply from every owner without a new one, so the caller's own final event (an
    error, at last_seq + 1 and this epoch) is the only one the log can still take."""
    return await _take_over(redis, reply_id, 0, expected_epoch, None, ttl_s)
