"""Shadow answers: what a rollout's candidate model version answered to a request mirrored to it
(GenerateRequest.shadow_of), recorded by the relay when the shadow reply's log closes and never
shown to anyone. Kept beside the reply it mirrors, so the candidate's answers can be read back
and compared with the ones the users saw.

A shadow answer is keyed by its own reply id: writing it again (a redelivered final event, a
retried store write) changes nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from tandem.bus.events import ReplyStatus


@dataclass(frozen=True)
class ShadowAnswer:
    reply_id: str  # the shadow reply's own id
    shadow_of: str  # the reply it mirrors (the one the user saw)
    user_id: str
    conversation_id: str  # the mirrored reply's conversation; empty: it had none (an OpenAI request)
    model: str  # the served model that wrote it, `name@version` kept whole
    text: str  # empty for a moderated answer, as a turn is stored
    num_output_tokens: int
    status: ReplyStatus  # how it ended, as a turn's status
    finish: str  # the final event's finish reason: "stop", "length", "cancelled", "content_filter", "error"
    stop_reason: str  # the rule that stopped it where the finish does not say ("repetition"); usually empty
    ttft_s: float  # from its creation to its first token; 0: none came
    created_ms: int
    finished_ms: int


# The stores' columns, in the fields' order (content: the text, output_tokens: num_output_tokens).
COLUMNS = "reply_id, shadow_of, user_id, conversation_id, model, content, output_tokens, status, finish, stop_reason, ttft_s, created_ms, finished_ms"
PLACEHOLDERS = ", ".join("?" for _ in COLUMNS.split(", "))


def as_row(answer: ShadowAnswer) -> tuple[Any, ...]:
    """Its values in COLUMNS' order, the status as its name."""
    return tuple((asdict(answer) | {"status": answer.status.value}).values())


def from_row(values: Sequence[Any]) -> ShadowAnswer:
    """From values in COLUMNS' order."""
    row = dict(zip((field.name for field in fields(ShadowAnswer)), values, strict=True))
    return ShadowAnswer(**row | {"status": ReplyStatus(row["status"])})


def in_order(answers: list[ShadowAnswer]) -> list[ShadowAnswer]:
    """The order `shadow_answers` returns them in: oldest first."""
    return sorted(answers, key=lambda answer: (answer.created_ms, answer.reply_id))
