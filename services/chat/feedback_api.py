"""POST /v1/messages/{id}/feedback: the caller rates an answer of theirs up or down, with an
optional reason and comment; rating it again replaces the rating. Stored with the turn (the
conversation store), shown with the message where messages are listed, and counted in
tandem_feedback_total by the model version that wrote the answer."""

from __future__ import annotations

from fastapi import APIRouter, Response

from services.chat import metrics
from services.chat.deps import Chat, CurrentUser
from services.chat.errors import InvalidRequest, NotFound
from services.chat.messages_api import owned_message
from services.chat.schemas import FeedbackBody
from tandem.store import Feedback, Role

router = APIRouter(prefix="/v1/messages", tags=["messages"])


@router.post("/{message_id}/feedback", status_code=204)
async def rate_answer(state: Chat, user: CurrentUser, message_id: str, body: FeedbackBody) -> Response:
    """204 for the answer's owner; 404 for anyone else and for an unknown id alike."""
    message, _ = await owned_message(state.store, user, message_id)
    if message.role != Role.ASSISTANT:
        raise InvalidRequest("only an answer (an assistant message) can be rated", code="not_an_answer")
    feedback = Feedback(
        message_id=message.id,
        conversation_id=message.conversation_id,
        rating=body.rating,
        reason=body.reason or "",
        comment=body.comment or "",
    )
    try:
        before = await state.store.rate_message(feedback)
    except KeyError:  # its conversation was deleted since it was read
        raise NotFound(f"message {message_id} not found", code="message_not_found") from None
    if before is None or before.rating != feedback.rating:  # a repeated vote (a retry) is not counted twice
        metrics.FEEDBACK.labels(**metrics.model_labels(message.model), vote=feedback.rating.value).inc()
    return Response(status_code=204)
