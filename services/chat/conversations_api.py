"""/v1/conversations: create, list (newest first), read, rename, delete, and send a message (an SSE stream)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response
from redis.asyncio import Redis
from sse_starlette.sse import EventSourceResponse

from services.chat import metrics
from services.chat.context import active_branch, parent_seqs
from services.chat.deps import Arrived, Chat, ChatTurns, CurrentUser, StreamAdmission, Streams
from services.chat.errors import Conflict, InvalidRequest, NotFound
from services.chat.latency import ReplyClock
from services.chat.limits import INT64_LIMIT
from services.chat.replies import cancel_reply, new_reply_id
from services.chat.schemas import ConversationChangeBody, MessageBody, NewConversationBody, conversation_summary, message_view, summary_view
from services.chat.streaming import ReplyStreams
from services.chat.turns import inflight_key
from tandem.bus.events import ReplyStatus, now_ms
from tandem.config import ApiKey
from tandem.store import Conversation, ConversationStore, Role
from tandem.tokenlog import as_text, load_reply

router = APIRouter(prefix="/v1/conversations", tags=["conversations"])
MAX_PAGE_CONVERSATIONS = 200


async def owned_conversation(store: ConversationStore, user: ApiKey, conversation_id: str) -> Conversation:
    conversation = await store.get_conversation(user.user_id, conversation_id)
    if conversation is None:
        raise NotFound(f"conversation {conversation_id} not found", code="conversation_not_found")
    return conversation


@router.post("", status_code=201)
async def create_conversation(state: Chat, user: CurrentUser, body: NewConversationBody | None = None) -> dict[str, str]:
    body = body or NewConversationBody()
    now = now_ms()
    conversation = Conversation(
        id=uuid.uuid4().hex, user_id=user.user_id, title=body.title, model=body.model, created_at_ms=now, updated_at_ms=now
    )
    await state.store.create_conversation(conversation)
    return {"id": conversation.id}


@router.get("")
async def list_conversations(
    state: Chat,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_CONVERSATIONS)] = 50,
    before_ms: Annotated[int | None, Query(ge=0, lt=INT64_LIMIT)] = None,
) -> dict[str, object]:
    conversations = await state.store.list_conversations(user.user_id, limit=limit, before_ms=before_ms)
    return {"conversations": [conversation_summary(c) for c in conversations]}


@router.get("/{conversation_id}")
async def get_conversation(state: Chat, streams: Streams, user: CurrentUser, conversation_id: str) -> dict[str, object]:
    """`messages`: the active branch (root to the newest message), each with its parent_id (and
    an answer with its user's rating, `feedback`);
    `tree`: every message (every regenerated answer and edited message), in seq order, for
    switching between branches."""
    conversation = await owned_conversation(state.store, user, conversation_id)
    messages, ratings = await asyncio.gather(state.store.list_messages(conversation_id), state.store.list_feedback(conversation_id))
    feedback = {f.message_id: f for f in ratings}
    parents = parent_seqs(messages)
    id_of_seq = {m.seq: m.id for m in messages}
    views = {}
    for m in messages:
        shown = await streams.as_logged(m) if m.status == ReplyStatus.RUNNING else m
        views[m.seq] = message_view(shown, id_of_seq.get(parents[m.seq]), feedback.get(m.id))
    branch = [views[m.seq] for m in active_branch(messages)]
    tree = [views[m.seq] for m in messages]
    return {
        "id": conversation.id,
        "title": conversation.title,
        "model": conversation.model,
        "summary": summary_view(conversation),  # what stands for the turns up to its upto_seq in prompts
        "messages": branch,
        "tree": tree,
    }


@router.patch("/{conversation_id}")
async def change_conversation(state: Chat, user: CurrentUser, conversation_id: str, body: ConversationChangeBody) -> dict[str, object]:
    changed = await state.store.update_conversation(user.user_id, conversation_id, title=body.title)
    if changed is None:
        raise NotFound(f"conversation {conversation_id} not found", code="conversation_not_found")
    return conversation_summary(changed)


@router.delete("/{conversation_id}", status_code=204)
async def delete_conversation(state: Chat, user: CurrentUser, conversation_id: str) -> Response:
    """Stops its running reply (the relay's final write then finds nothing), then deletes it."""
    await owned_conversation(state.store, user, conversation_id)
    running = [m.id for m in await state.store.list_messages(conversation_id) if m.status == ReplyStatus.RUNNING]
    for reply_id in running:
        meta = await load_reply(state.redis, reply_id)
        if meta is not None and meta.is_running:
            await cancel_reply(state.bus, reply_id, "deleted")
    await state.redis.delete(inflight_key(conversation_id))
    if not await state.store.delete_conversation(user.user_id, conversation_id):
        raise NotFound(f"conversation {conversation_id} not found", code="conversation_not_found")
    return Response(status_code=204)


def idempotency_key(user: ApiKey, conversation_id: str, key: str) -> str:
    digest = hashlib.sha256(f"{conversation_id}\n{key}".encode()).hexdigest()[:32]
    return f"tandem:idempotency:{user.user_id}:{digest}"


@router.post("/{conversation_id}/messages")
async def post_message(
    state: Chat,
    turns: ChatTurns,
    streams: Streams,
    user: CurrentUser,
    slot: StreamAdmission,  # an open stream's slot, taken before the reply starts (503/429 past a limit)
    arrived: Arrived,
    conversation_id: str,
    body: MessageBody,
    idempotency: Annotated[str | None, Header(alias="Idempotency-Key", max_length=200)] = None,
    last_event_id: Annotated[int, Header(alias="Last-Event-ID", ge=0, lt=INT64_LIMIT)] = 0,
) -> EventSourceResponse:
    conversation = await owned_conversation(state.store, user, conversation_id)
    after_seq = await branch_point(state.store, conversation_id, body)
    reply_id = new_reply_id()
    if idempotency:
        key = idempotency_key(user, conversation_id, idempotency)
        is_first = await state.redis.set(key, reply_id, nx=True, ex=state.config.idempotency_ttl_s)
        if not is_first:
            metrics.IDEMPOTENT_REPEATS.inc()
            earlier = as_text(await state.redis.get(key) or b"")
            return await attach_stream(state.redis, state.store, streams, earlier, last_event_id)
        try:
            # The user turn's id comes from the key: a retry after a refusal never stores it twice.
            user_message_id = key.rsplit(":", 1)[-1]
            started = await turns.send_message(
                user, conversation, body.content, body.model, reply_id, body.sampling(), user_message_id, after_seq
            )
        except BaseException:
            await state.redis.delete(key)  # nothing started: a retry may try again
            raise
    else:
        started = await turns.send_message(user, conversation, body.content, body.model, reply_id, body.sampling(), after_seq=after_seq)
    clock = ReplyClock(user.tier.value, started.model, arrived)
    route = started.route.as_dict() if started.route is not None else None
    return streams.response(started.reply_id, started.model, num_dropped_turns=started.num_dropped_turns, clock=clock, route=route)


async def branch_point(store: ConversationStore, conversation_id: str, body: MessageBody) -> int | None:
    """The seq the new user turn follows: the answer `parent_id`, or the parent of the user
    message `edit_of` (0: the root); None when the body names neither (after the newest message)."""
    if body.parent_id is None and body.edit_of is None:
        return None
    messages = await store.list_messages(conversation_id)
    by_id = {m.id: m for m in messages}
    if body.edit_of is not None:
        edited = by_id.get(body.edit_of)
        if edited is None or edited.role != Role.USER:
            raise InvalidRequest("edit_of must be a user message of this conversation", code="bad_edit_of", param="edit_of")
        return parent_seqs(messages)[edited.seq]
    parent = by_id.get(body.parent_id or "")
    if parent is None or parent.role != Role.ASSISTANT:
        raise InvalidRequest("parent_id must be an answer in this conversation", code="bad_parent", param="parent_id")
    return parent.seq


async def attach_stream(
    redis: Redis, store: ConversationStore, streams: ReplyStreams, reply_id: str, last_event_id: int
) -> EventSourceResponse:
    """The stream of a reply already started: from its log while kept, else from the store."""
    meta = await load_reply(redis, reply_id)
    if meta is not None:
        return streams.logged_response(meta, last_event_id)
    message = await store.get_message(reply_id)
    if message is None:
        raise Conflict("this Idempotency-Key was used for a request that is still starting; retry shortly", code="idempotency_key_in_use")
    return streams.finished_response(message, last_event_id)
