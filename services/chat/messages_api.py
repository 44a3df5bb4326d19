"""/v1/messages/{id}: resume a reply's stream, stop it, regenerate it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from sse_starlette.sse import EventSourceResponse

from services.chat.deps import Arrived, Chat, ChatTurns, CurrentUser, StreamAdmission, Streams
from services.chat.errors import InvalidRequest, NotFound
from services.chat.latency import ReplyClock
from services.chat.limits import INT64_LIMIT
from services.chat.replies import cancel_reply
from services.chat.schemas import RegenerateBody
from tandem.config import ApiKey
from tandem.store import Conversation, ConversationStore, Message, Role
from tandem.tokenlog import load_reply

router = APIRouter(prefix="/v1/messages", tags=["messages"])


async def owned_message(store: ConversationStore, user: ApiKey, message_id: str) -> tuple[Message, Conversation]:
    message = await store.get_message(message_id)
    conversation = await store.get_conversation(user.user_id, message.conversation_id) if message else None
    if message is None or conversation is None:
        raise NotFound(f"message {message_id} not found", code="message_not_found")
    return message, conversation


@router.get("/{message_id}/stream")
async def stream(
    state: Chat,
    streams: Streams,
    user: CurrentUser,
    slot: StreamAdmission,
    message_id: str,
    last_event_id: Annotated[int, Header(alias="Last-Event-ID", ge=0, lt=INT64_LIMIT)] = 0,
) -> EventSourceResponse:
    meta = await state.attach_reads.meta(message_id)
    if meta is not None and meta.is_running and meta.conversation_id and meta.user_id == user.user_id:
        # A running reply of the caller's conversation: its log says whose it is, so the store is
        # not asked (deleting the conversation stops the reply first).
        return streams.logged_response(meta, last_event_id)
    message, _ = await owned_message(state.store, user, message_id)
    if meta is None:
        return streams.finished_response(message, last_event_id)
    return streams.logged_response(meta, last_event_id)


@router.post("/{message_id}/stop")
async def stop(state: Chat, user: CurrentUser, message_id: str) -> dict[str, str]:
    message, _ = await owned_message(state.store, user, message_id)
    meta = await load_reply(state.redis, message_id)
    if meta is None or not meta.is_running:
        return {"id": message_id, "status": message.status.value}
    await cancel_reply(state.bus, message_id, "user")
    return {"id": message_id, "status": "stopping"}


@router.post("/{message_id}/regenerate")
async def regenerate_message(
    state: Chat,
    turns: ChatTurns,
    streams: Streams,
    user: CurrentUser,
    slot: StreamAdmission,
    arrived: Arrived,
    message_id: str,
    body: RegenerateBody | None = None,
) -> EventSourceResponse:
    body = body or RegenerateBody()
    message, conversation = await owned_message(state.store, user, message_id)
    if message.role != Role.ASSISTANT:
        raise InvalidRequest("only an assistant message can be regenerated", code="not_an_answer")
    started = await turns.regenerate(user, conversation, message, body.model, body.sampling())
    clock = ReplyClock(user.tier.value, started.model, arrived)
    route = started.route.as_dict() if started.route is not None else None
    return streams.response(started.reply_id, started.model, num_dropped_turns=started.num_dropped_turns, clock=clock, route=route)
