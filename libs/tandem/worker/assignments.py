"""The checks every worker makes of an Assignment before it takes one, and the refusals it answers
with (the router tries another worker, or tells the user, by the refusal's reason). Every
refusal is counted by reason."""

from __future__ import annotations

from tandem.bus import validate
from tandem.bus.events import now_ms
from tandem.engine.engine import InvalidGrammar, Request, TokenIdOutOfRange
from tandem.engine.scheduler import EmptyPrompt, PromptTooLong
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import Refusal
from tandem.worker import metrics
from tandem.worker.admission import QUEUE_FULL
from tandem.worker.host import EngineHost
from tandem.worker.thread import EngineDead
from tandem.worker.wire import engine_request


def refusal(reason: str, message: str, retry_after_s: float = 0.0) -> AssignmentReply:
    return AssignmentReply(refused=Refusal(reason=reason, message=message, retry_after_s=retry_after_s))


def is_expired(assignment: Assignment) -> bool:
    """The router stopped waiting for this worker's answer (and may have offered the reply to
    another worker): accepting now would run the reply twice."""
    return 0 < assignment.accept_by_unix_ms < now_ms()


async def screen_assignment(
    data: bytes, host: EngineHost, *, is_draining: bool, subject: str = "its assign subject"
) -> tuple[Assignment, Request] | AssignmentReply:
    """The refusal, or the assignment and the engine's request for it. `subject`: where it came,
    for the log of a bad one."""
    try:
        assignment = validate.assignment(data)  # the engine checks token ids against its vocabulary
    except validate.Invalid as exc:
        validate.drop("assignment", subject, exc)
        return refusal("bad_request", str(exc))
    try:
        request = engine_request(assignment.reply_id, assignment.request)
    except ValueError as exc:  # sampling out of the engine's ranges
        return refusal("bad_request", str(exc))
    if host.failure is not None:
        return refusal("unavailable", f"this worker failed and is restarting: {host.failure}", retry_after_s=1.0)
    if is_draining:
        return refusal("draining", "this worker is draining", retry_after_s=1.0)
    if not await host.is_ready():
        return refusal("loading", "this worker's engine is still loading its model", retry_after_s=2.0)
    if host.is_cancelled(assignment.reply_id):
        return refusal("cancelled", f"{assignment.reply_id} was cancelled before it started")
    if is_expired(assignment):
        return refusal("expired", f"{assignment.reply_id} reached this worker after the router's accept-by deadline")
    return assignment, request


async def unrunnable(host: EngineHost, request: Request) -> AssignmentReply | None:
    """The refusal for a request this engine could never run, or None."""
    try:
        await host.check(request)
    except EngineDead:  # the host has failed, and its worker is going away
        return refusal("loading", "this worker's engine has stopped", retry_after_s=2.0)
    except PromptTooLong as exc:
        return refusal("prompt_too_long", str(exc))
    except (EmptyPrompt, TokenIdOutOfRange, InvalidGrammar) as exc:
        return refusal("bad_request", str(exc))
    return None


def too_busy(host: EngineHost, request: Request, epoch: int = 0) -> AssignmentReply | None:
    """The "queue_full" refusal for a request this worker would not start within its lane's TTFT
    target (or, for background work, on idle capacity), with the seconds after which it expects
    to take one; None when it takes it.

    A continuation (epoch > 0: its first owner was lost) is never refused for its wait: its
    client is mid-answer, and a refusal from every worker would end the reply with an error
    instead of a longer pause. It still takes its place in its lane's queue."""
    if epoch > 0:
        return None
    overloaded = host.overloaded(request)
    if overloaded is None:
        return None
    return refusal(QUEUE_FULL, overloaded.message, retry_after_s=overloaded.retry_after_s)


def counted(reply: AssignmentReply) -> AssignmentReply:
    """The reply, its refusal (if it is one) counted by reason."""
    if reply.WhichOneof("outcome") == "refused":
        metrics.ASSIGNMENTS_REFUSED.labels(reason=reply.refused.reason).inc()
    return reply
