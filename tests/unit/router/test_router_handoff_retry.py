"""A failed KV handoff comes back to the router, which places the reply again without the decode
worker that failed, continuing the numbering after the tokens already published; after a bounded
number of failures the reply ends with one error event. The workers are an in-process Assign that
answers as told and, for a prefill worker, publishes its HandoffOutcome the way the real one does."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from router_fakes import decode_worker, request

from services.router.dispatch import DispatchConfig
from services.router.generate import GenerateService
from services.router.placement import Placement, PlacementConfig
from services.router.workers import WorkerRegistry
from tandem.bus import encode, subjects
from tandem.v1.common_pb2 import FINISH_REASON_CANCELLED, FINISH_REASON_ERROR
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply, HandoffOutcome
from tandem.v1.generate_pb2 import Refusal
from tandem.v1.tokens_pb2 import TokenEvent

LONG_PROMPT_TOKENS = 64  # above the threshold below: prefilled remotely while a prefill worker is up


@dataclass
class _Msg:
    subject: str
    data: bytes


def prefill_worker(instance_id: str):
    worker = decode_worker(instance_id)
    worker.heartbeat.service.role = "prefill"
    return worker


class Fleet:
    """Offers recorded as (worker, assignment); each prefill offer's fate comes from `handoffs`:
    "commit", ("fail", published token ids), or a Refusal naming the decode worker."""

    def __init__(self, handoffs: list[object], cancel_on_offer: bool = False) -> None:
        self.handoffs = list(handoffs)
        self.cancel_on_offer = cancel_on_offer  # the user cancels while the handoff runs
        self.offers: list[tuple[str, Assignment]] = []
        self.events: list[TokenEvent] = []
        self.generate: GenerateService | None = None

    async def assign(self, worker_id: str, assignment: Assignment) -> AssignmentReply:
        self.offers.append((worker_id, assignment))
        if self.cancel_on_offer:
            await self.generate.on_cancel(_Msg(subjects.cancel(assignment.reply_id), b""))
        if not assignment.decode_worker_id:
            return AssignmentReply(accepted=True)  # a decode worker, prefilling locally
        fate = self.handoffs.pop(0)
        if isinstance(fate, Refusal):
            return AssignmentReply(refused=fate, failed_decode_worker_id=assignment.decode_worker_id)
        result = HandoffOutcome.RESULT_COMMITTED if fate == "commit" else HandoffOutcome.RESULT_FAILED
        outcome = HandoffOutcome(
            reply_id=assignment.reply_id, result=result, prefill_worker_id=worker_id, decode_worker_id=assignment.decode_worker_id
        )
        if fate == "stopping":  # the prefill worker shut down mid-prefill: not the decode worker's fault
            outcome.decode_worker_id, outcome.reason = "", "prefill_stopping"
        elif result == HandoffOutcome.RESULT_FAILED:
            outcome.reason, outcome.message = "kv_transfer_failed", "receiver gone"
            outcome.published_token_ids.extend(fate[1])
        message = _Msg(subjects.handoff(assignment.reply_id), encode(outcome))
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.generate.outcomes.on_message(message)))
        return AssignmentReply(accepted=True)

    async def publish(self, event: TokenEvent) -> None:
        self.events.append(event)


def service(fleet: Fleet, num_decode_workers: int = 3) -> GenerateService:
    registry = WorkerRegistry()
    registry.observe(prefill_worker("p1").heartbeat)
    for i in range(1, num_decode_workers + 1):
        registry.observe(decode_worker(f"d{i}", num_running=i).heartbeat)  # d1 is the least loaded
    placement = Placement(PlacementConfig(remote_prefill_min_tokens=32))
    fleet.generate = GenerateService(registry, placement, fleet.assign, fleet.publish, DispatchConfig(max_handoff_attempts=2))
    return fleet.generate


async def run(generate: GenerateService, **fields) -> str:
    reply, job = generate.handle(request(LONG_PROMPT_TOKENS, **fields).SerializeToString())
    await asyncio.wait_for(generate.dispatch(job), 5)
    return reply.reply_id


async def test_a_handoff_that_fails_after_the_first_token_continues_on_another_decode_worker_after_it():
    fleet = Fleet([("fail", [42]), "commit"])
    await run(service(fleet))
    (p1, first), (p1_again, second) = fleet.offers
    assert (p1, first.decode_worker_id, first.first_seq) == ("p1", "d1", 1)
    assert (p1_again, second.decode_worker_id) == ("p1", "d2"), "placed again, without the decode worker that failed"
    assert list(second.request.generated_token_ids) == [42] and second.first_seq == 2
    assert list(second.request.prompt_token_ids) == list(first.request.prompt_token_ids)
    assert fleet.events == [], "a retried reply gets no error event"


async def test_a_decode_worker_that_refuses_the_reserve_is_avoided_without_asking_another_prefill_worker_for_it():
    fleet = Fleet([Refusal(reason="no_room", message="asked for 4 blocks, 1 free"), "commit"])
    await run(service(fleet))
    assert [(w, a.decode_worker_id, a.first_seq) for w, a in fleet.offers] == [("p1", "d1", 1), ("p1", "d2", 1)]
    assert not fleet.offers[1][1].request.generated_token_ids


async def test_when_every_handoff_fails_the_reply_ends_with_one_error_after_the_published_tokens(caplog):
    fleet = Fleet([("fail", [42]), ("fail", [43])])
    with caplog.at_level(logging.WARNING, logger="services.router.generate"):
        await run(service(fleet))
    assert [a.decode_worker_id for _, a in fleet.offers] == ["d1", "d2"]
    (event,) = fleet.events
    assert (event.seq, event.finish, event.error.code) == (3, FINISH_REASON_ERROR, "handoff_failed")
    assert "d1" not in event.error.message, "which workers failed is for the log"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "d1: kv_transfer_failed" in logged and "d2: kv_transfer_failed" in logged


async def test_when_no_decode_worker_is_left_the_failure_says_why():
    fleet = Fleet([("fail", [])])
    await run(service(fleet, num_decode_workers=1))
    (event,) = fleet.events
    assert (event.seq, event.error.code) == (1, "handoff_failed")


async def test_a_reply_cancelled_while_its_handoff_failed_ends_cancelled_not_retried():
    fleet = Fleet([("fail", [42])], cancel_on_offer=True)
    await run(service(fleet))
    assert len(fleet.offers) == 1
    (event,) = fleet.events
    assert (event.seq, event.finish) == (2, FINISH_REASON_CANCELLED)


def test_a_burst_of_long_prompts_spreads_over_the_prefill_workers_before_any_heartbeat():
    registry = WorkerRegistry()
    for worker in (prefill_worker("p1"), prefill_worker("p2"), decode_worker("d1")):
        registry.observe(worker.heartbeat)
    generate = GenerateService(registry, Placement(PlacementConfig(remote_prefill_min_tokens=32)), None, None)
    firsts = [generate.handle(request(LONG_PROMPT_TOKENS).SerializeToString())[1].remote[1][0] for _ in range(10)]
    assert firsts.count("p1") == firsts.count("p2") == 5


async def test_a_prefill_worker_that_stops_mid_handoff_returns_the_reply_to_the_same_decode_worker():
    fleet = Fleet(["stopping", "commit"])
    await run(service(fleet, num_decode_workers=1))  # avoiding d1 would leave no decode worker
    assert [(w, a.decode_worker_id, a.first_seq) for w, a in fleet.offers] == [("p1", "d1", 1), ("p1", "d1", 1)]
    assert fleet.events == []
