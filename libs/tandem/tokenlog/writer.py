"""The relay's side of the token log: one atomic append per TokenEvent; a batch of events (a
worker's step) is one pipeline of those appends, one round trip for all of them.

Appends are idempotent and ordered by sequence number, whatever delivers them and whichever
relay gets the event: a seq already logged is dropped, a seq that comes before the one preceding
it is held in the reply's pending hash until the gap fills, and the final event closes the log
(later seqs are dropped), starts its expiry and moves the reply from the running set to the
unpersisted one in the same step, so a relay that dies right after it still leaves the reply for
a sweep to store. An event from an owner epoch older than the reply's current one (a worker the
reply was taken from) is dropped and counted as stale. Every other event pushes the running
reply's expiry back.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from tandem.bus.events import ReplyStatus, is_final, now_ms, status_of_finish
from tandem.tokenlog.keys import REPLY_SET_TTL_S, RUNNING, RUNNING_REPLY_TTL_S, UNPERSISTED, ReplyKeys
from tandem.tokenlog.values import as_text
from tandem.v1.tokens_pb2 import TokenEvent

# KEYS: log, pending, meta, readers, running set, unpersisted set.
# ARGV: seq, event, final status ('' if not last), final ttl_s, now_ms, epoch, running ttl_s, set ttl_s, reply id.
# Returns {events appended, last seq logged, final status or '', events held, 1 if stale else 0}.
_APPEND = """
local last = tonumber(redis.call('HGET', KEYS[3], 'last_seq') or '0')
if tonumber(redis.call('HGET', KEYS[3], 'final_seq') or '0') > 0 then
  return {0, last, '', 0, 0}
end
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('HSET', KEYS[3], 'created_ms', ARGV[5], 'status', 'running')
end
local function keep_running()
  for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[7]) end
end
local seq, epoch = tonumber(ARGV[1]), tonumber(ARGV[6])
if epoch < tonumber(redis.call('HGET', KEYS[3], 'epoch') or '0') then
  redis.call('HINCRBY', KEYS[3], 'stale', 1)
  return {0, last, '', redis.call('HLEN', KEYS[2]) / 2, 1}
end
if seq <= last then
  keep_running()
  return {0, last, '', redis.call('HLEN', KEYS[2]) / 2, 0}
end
if seq > last + 1 then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2], 's:' .. ARGV[1], ARGV[3])
  redis.call('HSETNX', KEYS[3], 'gap_since_ms', ARGV[5])
  keep_running()
  return {0, last, '', redis.call('HLEN', KEYS[2]) / 2, 0}
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
redis.call('HSET', KEYS[3], 'last_seq', last, 'last_event_ms', ARGV[5])
if redis.call('HLEN', KEYS[2]) == 0 then redis.call('HDEL', KEYS[3], 'gap_since_ms') end
if status ~= '' then
  redis.call('HSET', KEYS[3], 'status', status, 'finished_ms', ARGV[5], 'final_seq', last)
  redis.call('HDEL', KEYS[3], 'gap_since_ms')
  redis.call('DEL', KEYS[2])
  for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
  redis.call('SREM', KEYS[5], ARGV[9])
  redis.call('SADD', KEYS[6], ARGV[9])
  redis.call('EXPIRE', KEYS[6], ARGV[8])
else
  keep_running()
end
return {appended, last, status, redis.call('HLEN', KEYS[2]) / 2, 0}
"""


@dataclass(frozen=True)
class Appended:
    num_appended: int  # 0: a duplicate, stale, or held behind a gap
    last_seq: int  # the last seq now in the log
    final_status: ReplyStatus | None  # set when this append closed the log
    num_held: int  # events waiting for a gap to fill
    is_stale: bool = False  # dropped: its owner epoch is older than the reply's


class TokenLogWriter:
    def __init__(self, redis: Redis, ttl_s: int, *, running_ttl_s: int = RUNNING_REPLY_TTL_S) -> None:
        """`ttl_s`: how long a closed log stays readable; `running_ttl_s`: the expiry every event
        of a running reply pushes back (settings.running_reply_ttl_s)."""
        if ttl_s < 1 or running_ttl_s < 1:
            raise ValueError(f"the token log's expiries must be at least 1 s; got {ttl_s} and {running_ttl_s}")
        self._redis = redis
        self._ttl_s = ttl_s
        self._running_ttl_s = running_ttl_s
        self._append = redis.register_script(_APPEND)

    @property
    def redis(self) -> Redis:
        return self._redis

    async def append(self, event: TokenEvent, on: Redis | None = None) -> Appended:
        """`on`: another client of the same Redis to run it on (one connection held for a WAIT
        after it, tandem.tokenlog.replicated)."""
        keys, args = self._keys_and_args(event, now_ms())
        return _appended(await self._append(keys=keys, args=args, client=on))

    async def append_many(self, events: list[TokenEvent], on: Redis | None = None) -> list[Appended]:
        """Appends `events` in their order (each as `append` would) in one pipeline: one round trip.
        Not a transaction: an error part way leaves the appends before it done, and the caller
        sends them all again (a duplicate is dropped). Raises ValueError before anything is sent
        when an event cannot be logged, RedisError when Redis fails. `on`: as for `append`."""
        client = self._redis if on is None else on
        clock_ms = now_ms()
        calls = [self._keys_and_args(event, clock_ms) for event in events]
        results: list[object] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):  # a Redis that lost its scripts (restarted) gets the script again
            pipe = client.pipeline(transaction=False)
            for i in todo:
                keys, args = calls[i]
                pipe.evalsha(self._append.sha, len(keys), *keys, *args)
            answers = await pipe.execute(raise_on_error=False)
            for i, answer in zip(todo, answers, strict=True):
                results[i] = answer
            todo = [i for i in todo if isinstance(results[i], NoScriptError)]
            if not todo:
                break
            if attempt == 0:
                await client.script_load(_APPEND)
        for result in results:
            if isinstance(result, Exception):
                raise result
        return [_appended(result) for result in results]  # type: ignore[arg-type]

    def _keys_and_args(self, event: TokenEvent, clock_ms: int) -> tuple[list[str], list[bytes | str | int]]:
        if not event.reply_id or event.seq < 1:
            raise ValueError(f"a logged event needs a reply id and a seq from 1; got {event.reply_id!r} seq {event.seq}")
        status = status_of_finish(event.finish).value if is_final(event) else ""
        keys = [*ReplyKeys(event.reply_id).all(), RUNNING, UNPERSISTED]
        args: list[bytes | str | int] = [
            event.seq,
            event.SerializeToString(),
            status,
            self._ttl_s,
            clock_ms,
            event.epoch,
            self._running_ttl_s,
            REPLY_SET_TTL_S,
            event.reply_id,
        ]
        return keys, args


def _appended(answer: list[object]) -> Appended:
    num_appended, last_seq, final, num_held, is_stale = answer
    final_text = as_text(final)  # type: ignore[arg-type]
    return Appended(
        int(num_appended),  # type: ignore[call-overload]
        int(last_seq),  # type: ignore[call-overload]
        ReplyStatus(final_text) if final_text else None,
        int(num_held),  # type: ignore[call-overload]
        is_stale=bool(is_stale),
    )
