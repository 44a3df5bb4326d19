"""What a reply's token events mean, defined once for every service: the event that ends a reply
(finished, cancelled or failed), the name of each finish reason as clients see it, the status a
reply ends in, and the wall clock in milliseconds that events and stores carry."""

from __future__ import annotations

import time
from enum import Enum

from tandem.v1.common_pb2 import (
    FINISH_REASON_CANCELLED,
    FINISH_REASON_CONTENT_FILTER,
    FINISH_REASON_ERROR,
    FINISH_REASON_LENGTH,
    FINISH_REASON_STOP,
    FINISH_REASON_UNSPECIFIED,
    Error,
    FinishReason,
    Usage,
)
from tandem.v1.tokens_pb2 import TokenEvent

# The finish reason of a final TokenEvent as the product's `done` event names it; an error has
# its own event and is never a `done`.
FINISH_NAMES: dict[int, str] = {
    FINISH_REASON_STOP: "stop",
    FINISH_REASON_LENGTH: "length",
    FINISH_REASON_CANCELLED: "cancelled",
    FINISH_REASON_ERROR: "error",
    FINISH_REASON_CONTENT_FILTER: "content_filter",
}


class ReplyStatus(str, Enum):
    """A reply's state, in its token log and as the stored assistant turn."""

    RUNNING = "running"
    COMPLETE = "complete"
    STOPPED = "stopped"
    FAILED = "failed"
    MODERATED = "moderated"


FINAL_STATUSES = frozenset({ReplyStatus.COMPLETE, ReplyStatus.STOPPED, ReplyStatus.FAILED, ReplyStatus.MODERATED})


def now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch (comparable across processes)."""
    return int(time.time() * 1000)


def is_final(event: TokenEvent) -> bool:
    return event.finish != FINISH_REASON_UNSPECIFIED


def served_model(events: list[TokenEvent]) -> str:
    """The served model a reply's worker named on its final event (a router's or relay's final
    names none): the version that wrote the reply; empty when no event names one."""
    return next((event.model for event in reversed(events) if event.model), "")


def finish_name(finish: int) -> str:
    """The client-facing name: "stop", "length", "cancelled", "content_filter" or "error"; raises ValueError for an event that ends nothing."""
    try:
        return FINISH_NAMES[finish]
    except KeyError:
        raise ValueError(f"finish reason {finish} does not end a reply") from None


def status_of_finish(finish: int) -> ReplyStatus:
    """The status a reply ends in, from its final event's finish reason."""
    if finish in (FINISH_REASON_STOP, FINISH_REASON_LENGTH):
        return ReplyStatus.COMPLETE
    if finish == FINISH_REASON_CANCELLED:
        return ReplyStatus.STOPPED
    if finish == FINISH_REASON_ERROR:
        return ReplyStatus.FAILED
    if finish == FINISH_REASON_CONTENT_FILTER:
        return ReplyStatus.MODERATED
    raise ValueError(f"finish reason {finish} does not end a reply")


def finish_of_status(status: ReplyStatus) -> FinishReason | None:
    """The finish a reply that ended with `status` reports, for one read back from the store
    (which does not keep whether a complete reply stopped or hit its length); None for a status
    that ends in an error (failed) or does not end (running)."""
    if status == ReplyStatus.MODERATED:
        return FINISH_REASON_CONTENT_FILTER
    if status == ReplyStatus.COMPLETE:
        return FINISH_REASON_STOP
    if status == ReplyStatus.STOPPED:
        return FINISH_REASON_CANCELLED
    return None


def final_event(
    reply_id: str,
    seq: int,
    finish: FinishReason,
    *,
    worker_id: str = "",
    text: str = "",
    token_id: int | None = None,
    usage: Usage | None = None,
) -> TokenEvent:
    """The event that ends a reply at `seq` (STOP, LENGTH, CANCELLED or CONTENT_FILTER); `usage` for a reply that ran."""
    if finish not in (FINISH_REASON_STOP, FINISH_REASON_LENGTH, FINISH_REASON_CANCELLED, FINISH_REASON_CONTENT_FILTER):
        raise ValueError(f"a final event ends with stop, length, cancelled or content_filter, not {finish}; use error_event for a failure")
    event = TokenEvent(reply_id=reply_id, seq=seq, finish=finish, text=text, worker_id=worker_id, produced_unix_ms=now_ms())
    if token_id is not None:
        event.token_id = token_id
    if usage is not None:
        event.usage.CopyFrom(usage)
    return event


def cancelled_event(reply_id: str, seq: int, *, worker_id: str = "") -> TokenEvent:
    """Ends a reply that was cancelled before (or without) a worker ending it."""
    return final_event(reply_id, seq, FINISH_REASON_CANCELLED, worker_id=worker_id)


def error_event(reply_id: str, seq: int, code: str, message: str, *, retry_after_s: float | None = None, worker_id: str = "") -> TokenEvent:
    """Ends a reply that failed: `code` a stable machine name, `message` what the user can do."""
    error = Error(code=code, message=message)
    if retry_after_s is not None:
        error.retry_after_s = retry_after_s
    return TokenEvent(reply_id=reply_id, seq=seq, finish=FINISH_REASON_ERROR, error=error, worker_id=worker_id, produced_unix_ms=now_ms())
