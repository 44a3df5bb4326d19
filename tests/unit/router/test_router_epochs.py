"""One owner per reply: every assignment of a reply carries the request's owner epoch (local,
remote, re-placed after a failed handoff), and so does every final event the router ends it with,
so the token log can tell the current owner's events from a former one's. A continuation (the
tokens already logged as generated tokens) is admitted like any request that fits the window."""

from __future__ import annotations

import asyncio

from router_fakes import decode_worker, request
from test_router_handoff_retry import LONG_PROMPT_TOKENS, Fleet, service

from services.router.admission import Admitted, admit
from services.router.dispatch import DispatchConfig, dispatch, failure_event
from services.router.generate import GenerateService
from services.router.placement import Placement
from services.router.workers import WorkerRegistry
from tandem.bus import subjects
from tandem.v1.common_pb2 import FINISH_REASON_CANCELLED, FINISH_REASON_ERROR
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import Refusal
from tandem.v1.tokens_pb2 import TokenEvent

EPOCH = 3


def continuation_request(num_prompt_tokens: int = 8, num_generated: int = 5):
    return request(
        num_prompt_tokens,
        reply_id="r1",
        resume_reply_id="r1",
        generated_token_ids=list(range(100, 100 + num_generated)),
        epoch=EPOCH,
    )


def test_a_continuation_with_generated_tokens_is_admitted_when_prompt_and_tokens_fit():
    assert isinstance(admit(continuation_request(8000, 191), [decode_worker("d1")]), Admitted)


def test_a_continuations_assignment_carries_its_epoch_and_goes_on_after_the_logged_tokens():
    registry = WorkerRegistry()
    registry.observe(decode_worker("d1").heartbeat)
    generate = GenerateService(registry, Placement(), None, None, DispatchConfig())  # type: ignore[arg-type]
    reply, job = generate.handle(continuation_request().SerializeToString())
    assert reply.reply_id == "r1" and job is not None
    assert (job.assignment.epoch, job.assignment.first_seq, job.worker_ids) == (EPOCH, 6, ("d1",))
    _, first = generate.handle(request().SerializeToString())
    assert first is not None and first.assignment.epoch == 0, "a new reply is its first owner's"


async def test_remote_and_re_placed_assignments_keep_the_epoch_and_the_final_error_carries_it():
    fleet = Fleet([("fail", [42]), ("fail", [43])])
    generate = service(fleet)
    _, job = generate.handle(continuation_request(LONG_PROMPT_TOKENS, 2).SerializeToString())
    assert job is not None and job.remote is not None and job.remote[0].epoch == EPOCH
    await asyncio.wait_for(generate.dispatch(job), 5)
    assert [a.epoch for _, a in fleet.offers] == [EPOCH, EPOCH], "a re-placement after a failed handoff is the same owner"
    assert [a.first_seq for _, a in fleet.offers] == [3, 4]
    (event,) = fleet.events
    assert (event.finish, event.error.code, event.seq, event.epoch) == (FINISH_REASON_ERROR, "handoff_failed", 5, EPOCH)


async def test_a_reply_no_worker_takes_ends_with_an_error_in_its_epoch():
    events: list[TokenEvent] = []

    async def refuse(worker_id: str, assignment: Assignment) -> AssignmentReply:
        return AssignmentReply(refused=Refusal(reason="draining", message="stopping"))

    async def publish(event: TokenEvent) -> None:
        events.append(event)

    registry = WorkerRegistry()
    registry.observe(decode_worker("d1").heartbeat)
    generate = GenerateService(registry, Placement(), refuse, publish, DispatchConfig())
    _, job = generate.handle(continuation_request().SerializeToString())
    assert job is not None
    await generate.dispatch(job)
    (event,) = events
    assert (event.finish, event.error.code, event.seq, event.epoch) == (FINISH_REASON_ERROR, "draining", 6, EPOCH)


async def test_a_reply_cancelled_before_any_worker_ends_cancelled_in_its_epoch():
    fleet = Fleet([])
    generate = service(fleet)
    _, job = generate.handle(continuation_request().SerializeToString())
    assert job is not None

    class Cancel:
        subject = subjects.cancel("r1")
        data = b""

    await generate.on_cancel(Cancel())  # type: ignore[arg-type]
    await generate.dispatch(job)
    (event,) = fleet.events
    assert (event.finish, event.seq, event.epoch) == (FINISH_REASON_CANCELLED, 6, EPOCH)
    assert fleet.offers == []


async def test_failure_event_takes_the_assignments_epoch():
    assignment = Assignment(reply_id="r1", request=request(), first_seq=4, epoch=EPOCH)
    result = await dispatch(None, assignment, [], DispatchConfig())  # type: ignore[arg-type]  # no worker: nothing is offered
    event = failure_event(assignment, result, DispatchConfig())
    assert (event.seq, event.epoch, event.error.code) == (4, EPOCH, "no_workers")


async def test_a_final_event_whose_publish_fails_is_retried():
    attempts: list[TokenEvent] = []

    async def flaky_publish(event: TokenEvent) -> None:
        attempts.append(event)
        if len(attempts) < 2:
            raise TimeoutError("JetStream did not acknowledge")

    async def refuse(worker_id: str, assignment: Assignment) -> AssignmentReply:
        return AssignmentReply(refused=Refusal(reason="draining"))

    registry = WorkerRegistry()
    registry.observe(decode_worker("d1").heartbeat)
    generate = GenerateService(registry, Placement(), refuse, flaky_publish, DispatchConfig())
    _, job = generate.handle(continuation_request().SerializeToString())
    assert job is not None
    await generate.dispatch(job)
    assert len(attempts) == 2 and attempts[0] == attempts[1]
