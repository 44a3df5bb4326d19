"""What the log keeps about a reply beside its tokens: owner, conversation, model, status,
the original GenerateRequest (so a reply can be resubmitted as a continuation), its owner epoch,
and times."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT

from tandem.bus.events import ReplyStatus, now_ms
from tandem.tokenlog.keys import REPLY_SET_TTL_S, RUNNING, RUNNING_REPLY_TTL_S, ReplyKeys
from tandem.tokenlog.values import as_bytes, as_text


@dataclass(frozen=True)
class ReplyMeta:
    reply_id: str
    user_id: str = ""
    conversation_id: str = ""  # empty: a reply no conversation stores (OpenAI endpoint, bus clients)
    message_id: str = ""
    model: str = ""
    status: ReplyStatus = ReplyStatus.RUNNING
    created_ms: int = 0
    finished_ms: int = 0
    last_seq: int = 0  # the last seq appended to the log
    request: bytes = b""  # the GenerateRequest as sent
    is_tracking_readers: bool = False  # cancelled once nobody reads it
    epoch: int = 0  # the owner epoch whose events the log accepts
    num_continuations: int = 0  # times the relay resubmitted it
    continued_ms: int = 0  # when it was last resubmitted; 0: never
    last_event_ms: int = 0  # when an event was last appended; 0: none yet
    cancel_sent_ms: int = 0  # when the relay cancelled it for want of readers; 0: never
    gap_since_ms: int = 0  # since when an event waits for a missing one before it; 0: no gap
    # What its first `meta` event said, so every later reader of the log is told the same:
    num_dropped_turns: int = 0  # older turns left out of its prompt
    route_json: str = ""  # how its model was chosen, as JSON; empty: not chosen (asked for by name, or not said yet)

    @property
    def is_running(self) -> bool:
        return self.status == ReplyStatus.RUNNING

    @property
    def dispatched_ms(self) -> int:
        """When its current owner was asked for: at creation or at its last continuation."""
        return max(self.created_ms, self.continued_ms)

    @classmethod
    def from_hash(cls, reply_id: str, fields: Mapping[bytes | str, bytes | str]) -> ReplyMeta:
        values = {as_text(k): v for k, v in fields.items()}

        def field(name: str) -> str:
            return as_text(values[name]) if name in values else ""

        def number(name: str) -> int:
            return int(field(name) or 0)

        return cls(
            reply_id=reply_id,
            user_id=field("user_id"),
            conversation_id=field("conversation_id"),
            message_id=field("message_id"),
            model=field("model"),
            status=ReplyStatus(field("status") or ReplyStatus.RUNNING.value),
            created_ms=number("created_ms"),
            finished_ms=number("finished_ms"),
            last_seq=number("last_seq"),
            request=as_bytes(values.get("request", b"")),
            is_tracking_readers=field("track_readers") == "1",
            epoch=number("epoch"),
            num_continuations=number("continuations"),
            continued_ms=number("continued_ms"),
            last_event_ms=number("last_event_ms"),
            cancel_sent_ms=number("cancel_sent_ms"),
            gap_since_ms=number("gap_since_ms"),
            num_dropped_turns=number("dropped_turns"),
            route_json=field("route"),
        )


async def create_reply(redis: Redis, meta: ReplyMeta, *, track_readers: bool, ttl_s: int = RUNNING_REPLY_TTL_S) -> None:
    """Records a reply before its request is sent, so its first token always finds it, and lists
    it as running, so the relay watches it (and continues it if its worker is lost). With
    `track_readers`, the relay also cancels it once nobody has read it for a while. `ttl_s`:
    settings.running_reply_ttl_s; every event pushes it back."""
    keys = ReplyKeys(meta.reply_id)
    fields: dict[FieldT, EncodableT] = {
        "user_id": meta.user_id,
        "conversation_id": meta.conversation_id,
        "message_id": meta.message_id,
        "model": meta.model,
        "status": meta.status.value,
        "created_ms": meta.created_ms or now_ms(),
        "last_reader_ms": meta.created_ms or now_ms(),
        "request": meta.request,
        "track_readers": "1" if track_readers else "0",
        "dropped_turns": meta.num_dropped_turns,
    }
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.meta, mapping=fields)
        pipe.expire(keys.meta, ttl_s)
        pipe.sadd(RUNNING, meta.reply_id)
        pipe.expire(RUNNING, REPLY_SET_TTL_S)
        await pipe.execute()


# Only on a meta hash that is still there, so the key keeps its TTL (a missing one is not made anew).
_SET_IF_LOGGED = "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], unpack(ARGV)) end"


async def set_answered(redis: Redis, reply_id: str, model: str, route_json: str) -> None:
    """Records what a reply's admission decided after it was created: the model that answers it
    and how that model was chosen (`route_json`; empty: leave it unsaid)."""
    fields = ["model", model, *(["route", route_json] if route_json else [])]
    await redis.eval(_SET_IF_LOGGED, 1, ReplyKeys(reply_id).meta, *fields)


# Every field of a reply's meta hash but its request (which can be large).
_FIELDS_BUT_REQUEST = (
    "user_id",
    "conversation_id",
    "message_id",
    "model",
    "status",
    "created_ms",
    "finished_ms",
    "last_seq",
    "track_readers",
    "epoch",
    "continuations",
    "continued_ms",
    "last_event_ms",
    "cancel_sent_ms",
    "gap_since_ms",
    "dropped_turns",
    "route",
)


def _without_request(reply_id: str, values: Sequence[bytes | str | None]) -> ReplyMeta | None:
    """The meta from an HMGET of _FIELDS_BUT_REQUEST; None when the hash is gone (no status)."""
    fields: dict[bytes | str, bytes | str] = {
        name.encode(): value for name, value in zip(_FIELDS_BUT_REQUEST, values, strict=True) if value is not None
    }
    return ReplyMeta.from_hash(reply_id, fields) if b"status" in fields else None


async def load_reply(redis: Redis, reply_id: str, *, with_request: bool = True) -> ReplyMeta | None:
    """The reply's meta; None when its log is gone. `with_request=False` leaves out the request
    (the whole prompt's tokens), for a caller that only streams the reply."""
    key = ReplyKeys(reply_id).meta
    if not with_request:
        return _without_request(reply_id, await redis.hmget(key, _FIELDS_BUT_REQUEST))
    fields = await redis.hgetall(key)
    return ReplyMeta.from_hash(reply_id, fields) if fields else None


async def load_reply_states(redis: Redis, reply_ids: Sequence[str]) -> dict[str, ReplyMeta | None]:
    """The meta of many replies in one round trip, without their requests; None for one that is gone."""
    async with redis.pipeline(transaction=False) as pipe:
        for reply_id in reply_ids:
            pipe.hmget(ReplyKeys(reply_id).meta, _FIELDS_BUT_REQUEST)
        rows = await pipe.execute()
    return {reply_id: _without_request(reply_id, values) for reply_id, values in zip(reply_ids, rows, strict=True)}
