"""Shadow answers' contract on both stores, Cassandra's real node included: an answer reads back
whole under the reply it mirrors, oldest first; one written again, or by several writers at once,
is stored once; the answers of another reply are not mixed in; deleting
the mirrored reply's conversation deletes them."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

from tandem.bus.events import ReplyStatus
from tandem.store import Conversation, ConversationStore, NewMessage, Role, ShadowAnswer


def shadow_answer(shadow_of: str, conversation_id: str = "", created_ms: int = 1_000, **changes: object) -> ShadowAnswer:
    answer = ShadowAnswer(
        reply_id=f"shadow-{uuid.uuid4().hex}",
        shadow_of=shadow_of,
        user_id="alice",
        conversation_id=conversation_id,
        model="smollm2@2",
        text="Paris is the capital of France. ✓",
        num_output_tokens=9,
        status=ReplyStatus.COMPLETE,
        finish="stop",
        stop_reason="",
        ttft_s=0.125,
        created_ms=created_ms,
        finished_ms=created_ms + 900,
    )
    return replace(answer, **changes)  # type: ignore[arg-type]


async def test_shadow_answers_read_back_whole_oldest_first_and_only_their_replys(store: ConversationStore):
    primary, other = f"reply-{uuid.uuid4().hex}", f"reply-{uuid.uuid4().hex}"
    later = shadow_answer(primary, created_ms=2_000, status=ReplyStatus.FAILED, finish="error", text="", num_output_tokens=0, ttft_s=0.0)
    earlier = shadow_answer(primary, created_ms=1_000, finish="length", stop_reason="repetition")
    for answer in (later, earlier, shadow_answer(other)):
        await store.record_shadow_answer(answer)
    assert await store.shadow_answers(primary) == [earlier, later]
    assert [answer.shadow_of for answer in await store.shadow_answers(other)] == [other]
    assert await store.shadow_answers(f"reply-{uuid.uuid4().hex}") == []


async def test_a_shadow_answer_written_again_and_by_writers_at_once_is_stored_once(new_store):
    first, second = await new_store(), await new_store()
    primary = f"reply-{uuid.uuid4().hex}"
    answer = shadow_answer(primary)
    await asyncio.gather(*(store.record_shadow_answer(answer) for store in (first, second, first, second)))  # redelivered, retried
    await first.record_shadow_answer(answer)
    for store in (first, second):
        assert await store.shadow_answers(primary) == [answer]


async def test_deleting_the_conversation_deletes_its_replies_shadow_answers(store: ConversationStore):
    conversation = await store.create_conversation(Conversation(f"conv-{uuid.uuid4().hex}", "alice", "t", "auto", 1_000, 1_000))
    kept = f"reply-{uuid.uuid4().hex}"  # another conversation's reply
    reply = await store.append_message(
        "alice",
        NewMessage(f"msg-{uuid.uuid4().hex}", conversation.id, Role.ASSISTANT, "", 0, model="smollm2@1", status=ReplyStatus.RUNNING),
    )
    await store.record_shadow_answer(shadow_answer(reply.id, conversation_id=conversation.id))
    await store.record_shadow_answer(shadow_answer(kept, conversation_id=f"conv-{uuid.uuid4().hex}"))
    assert len(await store.shadow_answers(reply.id)) == 1
    assert await store.delete_conversation("alice", conversation.id) is True
    assert await store.shadow_answers(reply.id) == []
    assert len(await store.shadow_answers(kept)) == 1
