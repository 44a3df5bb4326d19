"""A new reply placed on decode workers is answered once one took it, or with the refusal when
every one refused it (no error event: the caller says 503 at the door); an answer waits at most
answer_wait_s, after which a failure ends the reply with an error event as before; and the NATS
handler returns at once, so the next request does not wait behind a placement."""

from __future__ import annotations

import asyncio

from router_fakes import decode_worker, request

from services.router.dispatch import DispatchConfig
from services.router.generate import GenerateService
from services.router.placement import Placement
from services.router.workers import WorkerRegistry
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import GenerateReply
from tandem.v1.tokens_pb2 import TokenEvent


class Msg:
    """A NATS request: its payload, and the one answer it gets."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.reply = "_INBOX.test"
        self.answers: list[GenerateReply] = []
        self.answered = asyncio.Event()

    async def respond(self, data: bytes) -> None:
        self.answers.append(GenerateReply.FromString(data))
        self.answered.set()

    async def answer(self) -> GenerateReply:
        await asyncio.wait_for(self.answered.wait(), 5.0)
        [answer] = self.answers
        return answer


def service(assign, published: list[TokenEvent], answer_wait_s: float = 1.0) -> GenerateService:
    registry = WorkerRegistry()
    for worker in (decode_worker("d1"), decode_worker("d2")):
        registry.observe(worker.heartbeat)

    async def publish(event: TokenEvent) -> None:
        published.append(event)

    return GenerateService(registry, Placement(), assign, publish, DispatchConfig(answer_wait_s=answer_wait_s))


async def full(worker_id: str, assignment: Assignment) -> AssignmentReply:
    retry_after_s = {"d1": 6.0, "d2": 3.0}[worker_id]
    return AssignmentReply(refused={"reason": "queue_full", "message": "wait", "retry_after_s": retry_after_s})


async def test_a_reply_every_worker_refuses_as_full_is_refused_overloaded_with_the_soonest_eta_and_no_event():
    published: list[TokenEvent] = []
    generate = service(full, published)
    msg = Msg(request().SerializeToString())
    await generate.on_request(msg)
    answer = await msg.answer()
    assert (answer.WhichOneof("outcome"), answer.refused.reason, answer.refused.retry_after_s) == ("refused", "overloaded", 3.0)
    await generate.wait_idle(5.0)
    assert published == [], "the caller was told: no error event ends a reply it never started"


async def test_a_reply_a_worker_takes_is_answered_accepted_after_it_took_it():
    offered: list[str] = []

    async def second_takes(worker_id: str, assignment: Assignment) -> AssignmentReply:
        offered.append(worker_id)
        return AssignmentReply(accepted=True) if len(offered) == 2 else await full(worker_id, assignment)

    published: list[TokenEvent] = []
    msg = Msg(request().SerializeToString())
    await service(second_takes, published).on_request(msg)
    answer = await msg.answer()
    assert answer.WhichOneof("outcome") == "reply_id" and answer.reply_id and len(offered) == 2
    assert published == []


async def test_past_answer_wait_the_reply_is_accepted_and_a_later_refusal_ends_it_with_an_error_event():
    release = asyncio.Event()

    async def slow_then_full(worker_id: str, assignment: Assignment) -> AssignmentReply:
        await release.wait()
        return await full(worker_id, assignment)

    published: list[TokenEvent] = []
    generate = service(slow_then_full, published, answer_wait_s=0.05)
    msg = Msg(request().SerializeToString())
    await generate.on_request(msg)
    assert msg.answers == [], "the handler returned before the placement: the next request is not held up"
    answer = await msg.answer()
    assert answer.WhichOneof("outcome") == "reply_id" and answer.reply_id
    release.set()
    await generate.wait_idle(5.0)
    assert [(event.reply_id, event.error.code) for event in published] == [(answer.reply_id, "overloaded")]
