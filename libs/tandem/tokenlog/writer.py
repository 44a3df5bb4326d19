"""The relay's side of the token log: one atomic append per TokenEvent.

Appends are idempotent and ordered by sequence number, whatever NATS delivers and whichever
relay of the queue group gets the event: a seq already logged is dropped, a seq that comes
before the one preceding it is held in the reply's pending hash until the gap fills, and the
final event closes the log (later seqs are dropped) and starts its expiry.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from tandem.bus.events import ReplyStatus, is_final, now_ms, status_of_finish
from tandem.tokenlog.keys import ReplyKeys
from tandem.tokenlog.values import as_text
from tandem.v1.tokens_pb2 import TokenEvent

# KEYS: log, pending, meta, readers. ARGV: seq, event, final status ('' if not last), ttl_s, now_ms.
# Returns {events appended, last seq logged, final status or '', events held}.
_APPEND = """
local last = tonumber(redis.call('HGET', KEYS[3], 'last_seq') or '0')
local final_seq = tonumber(redis.call('HGET', KEYS[3], 'final_seq') or '0')
local seq = tonumber(ARGV[1])
redis.call('HSETNX', KEYS[3], 'created_ms', ARGV[5])
redis.call('HSETNX', KEYS[3], 'status', 'running')
if seq <= last or (final_seq > 0) then
  return {0, last, '', redis.call('HLEN', KEYS[2]) / 2}
end
if seq > last + 1 then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2], 's:' .. ARGV[1], ARGV[3])
  redis.call('HSETNX', KEYS[3], 'gap_since_ms', ARGV[5])
  return {0, last, '', redis.call('HLEN', KEYS[2]) / 2}
end
local event, status = ARGV[2], ARGV[3]
local appended = 0
while true do
  redis.call('XADD', KEYS[1], string.format('%d-1', seq), 'e', event)
  appended = appended + 1
  last = seq
  if status ~= '' then break end
  local following = string.format('%d', seq + 1)
  event = redis.call('HGET', KEYS[2], following)
  if not event then break end
  status = redis.call('HGET', KEYS[2], 's:' .. following)
  redis.call('HDEL', KEYS[2], following, 's:' .. following)
  seq = seq + 1
end
redis.call('HSET', KEYS[3], 'last_seq', last)
if redis.call('HLEN', KEYS[2]) == 0 then redis.call('HDEL', KEYS[3], 'gap_since_ms') end
if status ~= '' then
  redis.call('HSET', KEYS[3], 'status', status, 'finished_ms', ARGV[5], 'final_seq', last)
  redis.call('HDEL', KEYS[3], 'gap_since_ms')
  redis.call('DEL', KEYS[2])
  for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
end
return {appended, last, status, redis.call('HLEN', KEYS[2]) / 2}
"""


@dataclass(frozen=True)
class Appended:
    num_appended: int  # 0: a duplicate, or held behind a gap
    last_seq: int  # the last seq now in the log
    final_status: ReplyStatus | None  # set when this append closed the log
    num_held: int  # events waiting for a gap to fill


class TokenLogWriter:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        if ttl_s < 1:
            raise ValueError(f"the token log's expiry must be at least 1 s; got {ttl_s}")
        self._redis = redis
        self._ttl_s = ttl_s
        self._append = redis.register_script(_APPEND)

    async def append(self, event: TokenEvent) -> Appended:
        if not event.reply_id or event.seq < 1:
            raise ValueError(f"a logged event needs a reply id and a seq from 1; got {event.reply_id!r} seq {event.seq}")
        status = status_of_finish(event.finish).value if is_final(event) else ""
        keys = ReplyKeys(event.reply_id)
        num_appended, last_seq, final, num_held = await self._append(
            keys=list(keys.all()), args=[event.seq, event.SerializeToString(), status, self._ttl_s, now_ms()]
        )
        final_text = as_text(final)
        return Appended(int(num_appended), int(last_seq), ReplyStatus(final_text) if final_text else None, int(num_held))
