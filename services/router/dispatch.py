"""Handing an admitted reply to a decode worker: offer it to the best worker, then the next, at
most `max_attempts` in all. If none takes it, the reply ends with one error token event, so a
reader of its token log learns why instead of waiting for tokens that never come."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client

from services.router import metrics
from tandem.bus import encode, subjects, validate
from tandem.bus.events import error_event, now_ms
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import Refusal
from tandem.v1.tokens_pb2 import TokenEvent

ACCEPTED = "accepted"
REFUSED = "refused"
QUEUE_FULL = "queue_full"  # a worker's refusal: its queue is too long for the request's lane


@dataclass(frozen=True)
class DispatchConfig:
    assign_timeout_s: float = 2.0
    # A worker answering this close to the timeout refuses instead (Assignment.accept_by_unix_ms),
    # so a late acceptance can never run a reply the router has offered elsewhere.
    accept_margin_s: float = 0.25
    max_attempts: int = 3
    # Placements of one reply whose KV handoff failed (another decode worker, or local prefill)
    # before it ends with an error event.
    max_handoff_attempts: int = 3
    # How long a router waits for a prefill worker's HandoffOutcome (its whole prefill included).
    handoff_outcome_timeout_s: float = 300.0
    # Suggested to the caller when a worker was silent or unreachable (it may be back soon).
    retry_after_s: float = 2.0
    # How long the answer to a new reply placed on decode workers (local prefill) waits for one to
    # take it: a reply every worker refuses within it is refused to the caller (503 at the door),
    # not accepted and then ended with an error event after the client's 200.
    answer_wait_s: float = 1.0


class AssignFailed(Exception):
    """The worker gave no answer: `outcome` is "timeout", "no_responders", "bad_reply" or "error"."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail


# Offers an Assignment to one worker and returns its answer, or raises AssignFailed.
Assign = Callable[[str, Assignment], Awaitable[AssignmentReply]]


def nats_assign(client: Client, timeout_s: float, accept_margin_s: float = 0.25) -> Assign:
    """The production Assign: NATS request/reply on the worker's assign subject, with an accept-by
    deadline `accept_margin_s` before the router stops waiting."""

    async def assign(worker_id: str, assignment: Assignment) -> AssignmentReply:
        sent = Assignment()
        sent.CopyFrom(assignment)
        sent.accept_by_unix_ms = now_ms() + int(1000 * (timeout_s - accept_margin_s))
        try:
            msg = await client.request(subjects.assign(worker_id), encode(sent), timeout=timeout_s)
        except nats.errors.NoRespondersError:
            raise AssignFailed("no_responders", "nothing listens on its assign subject") from None
        except nats.errors.TimeoutError:
            raise AssignFailed("timeout", f"no answer within {timeout_s:g} s") from None
        except nats.errors.Error as exc:
            raise AssignFailed("error", f"NATS: {exc or type(exc).__name__}") from None
        try:
            return validate.assignment_reply(msg.data)
        except validate.Invalid as exc:
            validate.drop("assignment_reply", subjects.assign(worker_id), exc)
            raise AssignFailed("bad_reply", str(exc)) from None

    return assign


@dataclass(frozen=True)
class Attempt:
    worker_id: str
    outcome: str  # ACCEPTED, REFUSED, or an AssignFailed outcome
    refusal: Refusal | None = None
    detail: str = ""
    failed_decode_worker_id: str = ""  # a prefill worker's refusal that was its decode worker's

    def describe(self) -> str:
        if self.refusal is not None:
            return f"{self.worker_id} refused ({self.refusal.reason}: {self.refusal.message})"
        return f"{self.worker_id}: {self.detail}"


@dataclass(frozen=True)
class DispatchResult:
    attempts: tuple[Attempt, ...]

    @property
    def accepted_by(self) -> str | None:
        last = self.attempts[-1] if self.attempts else None
        return last.worker_id if last is not None and last.outcome == ACCEPTED else None

    def describe(self) -> str:
        """Who was tried and what each said, for the log (never for the client: it names workers)."""
        return "; ".join(a.describe() for a in self.attempts) or "no worker was tried"


async def dispatch(
    assign: Assign,
    assignment: Assignment,
    worker_ids: Sequence[str],
    config: DispatchConfig,
    on_retry: Callable[[str], None] = lambda worker_id: None,
) -> DispatchResult:
    """Offers `assignment` to `worker_ids` in order until one accepts. `on_retry` hears of each
    worker after the first as it is tried (the caller counted the first when it chose it)."""
    attempts: list[Attempt] = []
    for worker_id in worker_ids[: config.max_attempts]:
        if attempts:
            on_retry(worker_id)
        attempt = await _offer(assign, worker_id, assignment)
        metrics.DISPATCH_ATTEMPTS.labels(outcome=attempt.outcome).inc()
        attempts.append(attempt)
        if attempt.outcome == ACCEPTED or attempt.failed_decode_worker_id:
            break  # accepted; or the decode worker failed, which no other prefill worker changes
    return DispatchResult(tuple(attempts))


async def _offer(assign: Assign, worker_id: str, assignment: Assignment) -> Attempt:
    try:
        reply = await assign(worker_id, assignment)
    except AssignFailed as exc:
        return Attempt(worker_id, exc.outcome, detail=exc.detail)
    outcome = reply.WhichOneof("outcome")
    if outcome == "accepted" and reply.accepted:
        return Attempt(worker_id, ACCEPTED)
    if outcome == "refused":
        return Attempt(worker_id, REFUSED, refusal=reply.refused, failed_decode_worker_id=reply.failed_decode_worker_id)
    return Attempt(worker_id, "bad_reply", detail="its reply neither accepted nor refused")


def failure_event(assignment: Assignment, result: DispatchResult, config: DispatchConfig) -> TokenEvent:
    """The one event that ends a reply no worker took, in the assignment's owner epoch."""
    event = _failure_event(assignment, result, config)
    event.epoch = assignment.epoch
    return event


def _failure_event(assignment: Assignment, result: DispatchResult, config: DispatchConfig) -> TokenEvent:
    """Its code and words are the client's: which workers were tried and what they said is
    `result.describe()`, for the log."""
    attempts = result.attempts
    if not attempts:
        message = "no decode worker was left to take the reply; try again shortly"
        return error_event(assignment.reply_id, assignment.first_seq, "no_workers", message, retry_after_s=config.retry_after_s)
    reasons = {a.refusal.reason if a.refusal is not None else a.outcome for a in attempts}
    if reasons == {QUEUE_FULL}:
        # Every worker's queue is too long for the request's lane: the soonest any expects room.
        soonest_s = min(a.refusal.retry_after_s for a in attempts if a.refusal is not None)
        message = "every decode worker is too busy to start the reply in time; try again shortly"
        return error_event(
            assignment.reply_id, assignment.first_seq, "overloaded", message, retry_after_s=soonest_s or config.retry_after_s
        )
    # Every worker refusing for the same reason says more than a generic code.
    code = reasons.pop() if len(reasons) == 1 and attempts[0].refusal is not None else "no_worker_accepted"
    retry_after_s = max((a.refusal.retry_after_s if a.refusal is not None else config.retry_after_s) for a in attempts)
    message = f"no decode worker could take the reply ({len(attempts)} tried)"
    return error_event(assignment.reply_id, assignment.first_seq, code, message, retry_after_s=retry_after_s if retry_after_s > 0 else None)
