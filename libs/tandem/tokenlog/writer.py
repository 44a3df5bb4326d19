"""The relay's side of the token log: one atomic append per TokenEvent; a batch of events (a
worker's step, for many replies) is one script call that makes each of those appends in order,
one round trip and one short answer per event.

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

# One append, as a Lua function both scripts call. k: the reply's log, pending, meta and readers
# keys; the running and unpersisted sets; the event's seq, bytes, final status ('' if not last)
# and epoch; the closed log's ttl_s, now_ms, the running reply's ttl_s, the sets' ttl_s, reply id.
# Returns {events appended, last seq logged, final status or '', events held, 1 if stale else 0}.
_APPEND_FUNCTION = """
local function append(k, running_set, unpersisted_set, seq_s, event_in, status_in, epoch_s, final_ttl, now, running_ttl, set_ttl, reply_id)
  local last = tonumber(redis.call('HGET', k[3], 'last_seq') or '0')
  if tonumber(redis.call('HGET', k[3], 'final_seq') or '0') > 0 then
    return {0, last, '', 0, 0}
  end
  if redis.call('EXISTS', k[3]) == 0 then
    redis.call('HSET', k[3], 'created_ms', now, 'status', 'running')
  end
  local function keep_running()
    for i = 1, 4 do redis.call('EXPIRE', k[i], running_ttl) end
  end
  local seq, epoch = tonumber(seq_s), tonumber(epoch_s)
  if epoch < tonumber(redis.call('HGET', k[3], 'epoch') or '0') then
    redis.call('HINCRBY', k[3], 'stale', 1)
    return {0, last, '', redis.call('HLEN', k[2]) / 2, 1}
  end
  if seq <= last then
    keep_running()
    return {0, last, '', redis.call('HLEN', k[2]) / 2, 0}
  end
  if seq > last + 1 then
    redis.call('HSET', k[2], seq_s, event_in, 's:' .. seq_s, status_in)
    redis.call('HSETNX', k[3], 'gap_since_ms', now)
    keep_running()
    return {0, last, '', redis.call('HLEN', k[2]) / 2, 0}
  end
  local event, status = event_in, status_in
  local appended = 0
  while true do
    redis.call('XADD', k[1], string.format('%d-1', seq), 'e', event)
    appended = appended + 1
    last = seq
    if status ~= '' then break end
    local following = string.format('%d', seq + 1)
    event = redis.call('HGET', k[2], following)
    if not event then break end
    status = redis.call('HGET', k[2], 's:' .. following)
    redis.call('HDEL', k[2], following, 's:' .. following)
    seq = seq + 1
  end
  redis.call('HSET', k[3], 'last_seq', last, 'last_event_ms', now)
  if redis.call('HLEN', k[2]) == 0 then redis.call('HDEL', k[3], 'gap_since_ms') end
  if status ~= '' then
    redis.call('HSET', k[3], 'status', status, 'finished_ms', now, 'final_seq', last)
    redis.call('HDEL', k[3], 'gap_since_ms')
    redis.call('DEL', k[2])
    for i = 1, 4 do redis.call('EXPIRE', k[i], final_ttl) end
    redis.call('SREM', running_set, reply_id)
    redis.call('SADD', unpersisted_set, reply_id)
    redis.call('EXPIRE', unpersisted_set, set_ttl)
  else
    keep_running()
  end
  return {appended, last, status, redis.call('HLEN', k[2]) / 2, 0}
end
"""

# KEYS: log, pending, meta, readers, running set, unpersisted set.
# ARGV: seq, event, final status ('' if not last), final ttl_s, now_ms, epoch, running ttl_s, set ttl_s, reply id.
_APPEND = (
    _APPEND_FUNCTION
    + """
return append({KEYS[1], KEYS[2], KEYS[3], KEYS[4]}, KEYS[5], KEYS[6], ARGV[1], ARGV[2], ARGV[3], ARGV[6], ARGV[4], ARGV[5], ARGV[7], ARGV[8], ARGV[9])
"""
)

MAX_EVENTS_PER_CALL = 1024  # a larger batch is several calls, in the same pipeline

# A batch: every event appended as _APPEND would, in order, in one call.
# KEYS: running set, unpersisted set, then each reply's log, pending, meta, readers.
# ARGV: final ttl_s, now_ms, running ttl_s, set ttl_s, number of replies R, R reply ids, then per
# event: its reply's number (1..R), seq, event, final status ('' if not last), epoch.
# Returns one 'appended:last seq:final status:held:stale' per event (one reply element each:
# parsing them is most of what the batch costs the relay).
_APPEND_MANY = (
    _APPEND_FUNCTION
    + """
local num_replies = tonumber(ARGV[5])
local answers = {}
for i = 6 + num_replies, #ARGV, 5 do
  local r = tonumber(ARGV[i])
  local base = 2 + 4 * (r - 1)
  local k = {KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]}
  local a = append(k, KEYS[1], KEYS[2], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5 + r])
  answers[#answers + 1] = table.concat({a[1], a[2], a[3], a[4], a[5]}, ':')
end
return answers
"""
)


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
        self._append_many = redis.register_script(_APPEND_MANY)

    @property
    def redis(self) -> Redis:
        return self._redis

    async def append(self, event: TokenEvent, on: Redis | None = None) -> Appended:
        """`on`: another client of the same Redis to run it on (one connection held for a WAIT
        after it, tandem.tokenlog.replicated)."""
        keys, args = self._keys_and_args(event, now_ms())
        return _appended(await self._append(keys=keys, args=args, client=on))

    async def append_many(self, events: list[TokenEvent], on: Redis | None = None) -> list[Appended]:
        """Appends `events` in their order (each as `append` would) in one script call per
        MAX_EVENTS_PER_CALL events, all in one pipeline: one round trip. Not a transaction: an
        error part way leaves the appends before it done, and the caller sends them all again (a
        duplicate is dropped). Raises ValueError before anything is sent when an event cannot be
        logged, RedisError when Redis fails. `on`: as for `append`."""
        client = self._redis if on is None else on
        for event in events:
            _check(event)
        clock_ms = now_ms()
        calls = [
            self._many_keys_and_args(events[i : i + MAX_EVENTS_PER_CALL], clock_ms) for i in range(0, len(events), MAX_EVENTS_PER_CALL)
        ]
        answers: list[object] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):  # a Redis that lost its scripts (restarted) gets them again
            pipe = client.pipeline(transaction=False)
            for i in todo:
                keys, args = calls[i]
                pipe.evalsha(self._append_many.sha, len(keys), *keys, *args)
            for i, answer in zip(todo, await pipe.execute(raise_on_error=False), strict=True):
                answers[i] = answer
            todo = [i for i in todo if isinstance(answers[i], NoScriptError)]
            if not todo:
                break
            if attempt == 0:
                await client.script_load(_APPEND_MANY)
        appended: list[Appended] = []
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer
            appended += [_appended_of_text(as_text(text)) for text in answer]  # type: ignore[attr-defined]
        return appended

    def _many_keys_and_args(self, events: list[TokenEvent], clock_ms: int) -> tuple[list[str], list[bytes | str | int]]:
        numbers: dict[str, int] = {}  # reply id -> its number in the call, from 1
        keys: list[str] = [RUNNING, UNPERSISTED]
        per_event: list[bytes | str | int] = []
        for event in events:
            number = numbers.get(event.reply_id)
            if number is None:
                number = numbers[event.reply_id] = len(numbers) + 1
                keys += ReplyKeys(event.reply_id).all()
            status = status_of_finish(event.finish).value if is_final(event) else ""
            per_event += [number, event.seq, event.SerializeToString(), status, event.epoch]
        shared: list[bytes | str | int] = [self._ttl_s, clock_ms, self._running_ttl_s, REPLY_SET_TTL_S, len(numbers), *numbers]
        return keys, shared + per_event

    def _keys_and_args(self, event: TokenEvent, clock_ms: int) -> tuple[list[str], list[bytes | str | int]]:
        _check(event)
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


def _check(event: TokenEvent) -> None:
    if not event.reply_id or event.seq < 1:
        raise ValueError(f"a logged event needs a reply id and a seq from 1; got {event.reply_id!r} seq {event.seq}")


def _appended_of_text(text: str) -> Appended:
    num_appended, last_seq, final, num_held, is_stale = text.split(":")
    return Appended(int(num_appended), int(last_seq), ReplyStatus(final) if final else None, int(num_held), is_stale=is_stale == "1")


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
