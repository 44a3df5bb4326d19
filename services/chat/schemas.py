"""Request bodies and response shapes of the product API."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints, model_validator

from services.chat.limits import MaxTokens, ModelName, Seed, Temperature, TopP
from services.chat.turns import SamplingChoice
from tandem.store import Conversation, Feedback, Message, Rating

MAX_FEEDBACK_REASON_CHARS = 200
MAX_FEEDBACK_COMMENT_CHARS = 4000


class NewConversationBody(BaseModel):
    title: str = Field(default="", max_length=200)
    model: ModelName = "auto"


class SamplingBody(BaseModel):
    """The sampling options a message or a regenerate may set, bounded here (services.chat.limits)
    so that a value the engine's SamplingParams cannot hold is refused before a turn is stored."""

    temperature: Temperature = 0.7
    top_p: TopP = 0.9
    seed: Seed | None = None
    max_tokens: MaxTokens | None = None

    def sampling(self) -> SamplingChoice:
        return SamplingChoice(temperature=self.temperature, top_p=self.top_p, seed=self.seed, max_tokens=self.max_tokens)


class MessageBody(SamplingBody):
    """A new user turn: after the newest message, after the answer `parent_id` (continuing a branch
    the reader chose), or in place of the user message `edit_of` (a sibling of it: an edit)."""

    content: str
    model: ModelName = "auto"
    parent_id: str | None = Field(default=None, min_length=1, max_length=100)
    edit_of: str | None = Field(default=None, min_length=1, max_length=100)

    @model_validator(mode="after")
    def one_place(self) -> MessageBody:
        if self.parent_id is not None and self.edit_of is not None:
            raise ValueError("give parent_id or edit_of, not both")
        return self


class RegenerateBody(SamplingBody):
    model: ModelName = ""  # empty: the model of the answer being regenerated


class FeedbackBody(BaseModel):
    """POST /v1/messages/{id}/feedback: a rating of an answer; `reason` (a short label such as
    "inaccurate") and `comment` (free text) are optional."""

    rating: Rating
    reason: str | None = Field(default=None, max_length=MAX_FEEDBACK_REASON_CHARS)
    comment: str | None = Field(default=None, max_length=MAX_FEEDBACK_COMMENT_CHARS)


def iso(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def conversation_summary(conversation: Conversation) -> dict[str, object]:
    return {
        "id": conversation.id,
        "title": conversation.title,
        "model": conversation.model,
        "created_at": iso(conversation.created_at_ms),
        "updated_at": iso(conversation.updated_at_ms),
        "updated_at_ms": conversation.updated_at_ms,
    }


def summary_view(conversation: Conversation) -> dict[str, object] | None:
    """The summary that stands for the conversation's older turns in prompts (those with seq <=
    upto_seq), or None while it has none."""
    if not conversation.summary:
        return None
    return {"text": conversation.summary, "upto_seq": conversation.summary_upto_seq}


def feedback_view(feedback: Feedback | None) -> dict[str, object] | None:
    if feedback is None:
        return None
    return {"rating": feedback.rating.value, "reason": feedback.reason, "comment": feedback.comment, "rated_at": iso(feedback.rated_at_ms)}


def message_view(message: Message, parent_id: str | None = None, feedback: Feedback | None = None) -> dict[str, object]:
    """`parent_id`: the message it follows (None: the conversation's root); `feedback`: its
    user's rating (an answer's), None while it has none."""
    return {
        "id": message.id,
        "seq": message.seq,
        "parent_id": parent_id,
        "role": message.role.value,
        "content": message.content,
        "status": message.status.value,
        "model": message.model,
        "tokens": message.tokens,
        "created_at": iso(message.created_at_ms),
        "feedback": feedback_view(feedback),
    }


class ConversationChangeBody(BaseModel):
    """PATCH /v1/conversations/{id}: what may change (only its title, for now)."""

    title: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=200)]
