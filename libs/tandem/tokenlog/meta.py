"""What the log keeps about a reply beside its tokens: owner, conversation, model, status,
the original GenerateRequest (so a reply can be resubmitted as a continuation), and times."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT

from tandem.bus.events import ReplyStatus, now_ms
from tandem.tokenlog.keys import RUNNING, ReplyKeys
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

    @property
    def is_running(self) -> bool:
        return self.status == ReplyStatus.RUNNING

    @classmethod
    def from_hash(cls, reply_id: str, fields: Mapping[bytes | str, bytes | str]) -> ReplyMeta:
        values = {as_text(k): v for k, v in fields.items()}

        def field(name: str) -> str:
            return as_text(values[name]) if name in values else ""

        return cls(
            reply_id=reply_id,
            user_id=field("user_id"),
            conversation_id=field("conversation_id"),
            message_id=field("message_id"),
            model=field("model"),
            status=ReplyStatus(field("status") or ReplyStatus.RUNNING.value),
            created_ms=int(field("created_ms") or 0),
            finished_ms=int(field("finished_ms") or 0),
            last_seq=int(field("last_seq") or 0),
            request=as_bytes(values.get("request", b"")),
        )


async def create_reply(redis: Redis, meta: ReplyMeta, *, track_readers: bool) -> None:
    """Records a reply before its request is sent, so its first token always finds it.
    With `track_readers`, the relay cancels it once nobody has read it for a while."""
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
    }
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.meta, mapping=fields)
        if track_readers:
            pipe.sadd(RUNNING, meta.reply_id)
        await pipe.execute()


async def load_reply(redis: Redis, reply_id: str) -> ReplyMeta | None:
    fields = await redis.hgetall(ReplyKeys(reply_id).meta)
    return ReplyMeta.from_hash(reply_id, fields) if fields else None
