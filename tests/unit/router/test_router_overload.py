"""What each rung does at the door, through GenerateService.handle: paid is never degraded."""

import pytest
from router_fakes import MODEL, decode_worker, request

from services.router.dispatch import DispatchConfig
from services.router.generate import GenerateService
from services.router.ladder import FleetReading, Ladder
from services.router.lanes import LaneRefusals
from services.router.overload import Overload, OverloadConfig
from services.router.placement import Placement
from services.router.workers import WorkerRegistry
from tandem.v1.common_pb2 import LANE_BACKGROUND, LANE_FREE, LANE_PAID

INTERVAL_S = 10.0
CONFIG = OverloadConfig(free_max_tokens=300, start_deadline_s=2.0)


async def never_called(*args: object) -> None:
    raise AssertionError("the handler must not reach the network")


def ladder_at(rung: int) -> Ladder:
    clock = [0.0]
    ladder = Ladder(INTERVAL_S, clock=lambda: clock[0])
    for _ in range(rung):
        ladder.observe(FleetReading(kv_occupancy=1.0))
        clock[0] += INTERVAL_S
    assert ladder.rung == rung
    return ladder


def service(rung: int, *workers, refusals: LaneRefusals | None = None) -> GenerateService:
    registry = WorkerRegistry()
    for worker in workers or (decode_worker("d1"),):
        registry.observe(worker.heartbeat)
    overload = Overload(ladder_at(rung), CONFIG)
    return GenerateService(registry, Placement(), never_called, never_called, DispatchConfig(), overload, refusals=refusals)


def answer(generate: GenerateService, **fields):
    reply, job = generate.handle(request(model=MODEL, **fields).SerializeToString())
    return reply, job


def test_rung_0_takes_every_lane_as_asked():
    generate = service(0)
    for lane in (LANE_PAID, LANE_FREE, LANE_BACKGROUND):
        reply, job = answer(generate, lane=lane, max_tokens=1000)
        assert reply.WhichOneof("outcome") == "reply_id"
        assert job.assignment.request.sampling.max_tokens == 1000


def test_from_rung_1_background_work_is_refused_with_a_retry_and_free_keeps_its_model_when_no_small_one_is_served():
    generate = service(1)
    reply, job = answer(generate, lane=LANE_BACKGROUND)
    assert job is None
    assert reply.refused.reason == "overloaded"
    assert reply.refused.retry_after_s == INTERVAL_S
    reply, job = answer(generate, lane=LANE_FREE, max_tokens=1000)
    assert reply.model == MODEL
    assert job.assignment.request.sampling.max_tokens == 1000


def test_from_rung_1_a_free_message_goes_to_another_served_model_and_paid_stays():
    generate = service(1, decode_worker("big1"), decode_worker("big2"), decode_worker("small1", model="small"))
    reply, job = answer(generate, lane=LANE_FREE)
    assert reply.model == "small"
    assert job.worker_ids == ("small1",)
    assert answer(generate, lane=LANE_PAID)[0].model == MODEL


def test_from_rung_2_free_answers_are_capped_and_paid_are_not():
    generate = service(2)
    _, free_job = answer(generate, lane=LANE_FREE, max_tokens=1000)
    assert free_job.assignment.request.sampling.max_tokens == 300
    _, short_job = answer(generate, lane=LANE_FREE, max_tokens=20)
    assert short_job.assignment.request.sampling.max_tokens == 20
    _, paid_job = answer(generate, lane=LANE_PAID, max_tokens=1000)
    assert paid_job.assignment.request.sampling.max_tokens == 1000


def test_at_rung_3_a_free_message_that_cannot_start_in_time_is_refused_and_paid_is_admitted():
    generate = service(3, decode_worker("d1", estimated_wait_s=9.0), decode_worker("d2", estimated_wait_s=6.0))
    reply, job = answer(generate, lane=LANE_FREE)
    assert job is None
    assert reply.refused.reason == "overloaded"
    assert reply.refused.retry_after_s == pytest.approx(INTERVAL_S)  # a rung lasts an observation
    assert "cannot start within 2 s" in reply.refused.message
    paid_reply, paid_job = answer(generate, lane=LANE_PAID)
    assert paid_reply.WhichOneof("outcome") == "reply_id" and paid_job is not None


def test_at_rung_3_the_start_deadline_scales_with_each_workers_stated_target():
    # a CPU worker allowing 20 s (10x the 2 s free target): its deadline is 20 s, not 2 s
    generate = service(3, decode_worker("cpu", estimated_wait_s=15.0, free_ttft_target_s=20.0))
    reply, _ = answer(generate, lane=LANE_FREE)
    assert reply.WhichOneof("outcome") == "reply_id"
    generate = service(3, decode_worker("cpu", estimated_wait_s=35.0, free_ttft_target_s=20.0))
    reply, _ = answer(generate, lane=LANE_FREE)
    assert reply.refused.reason == "overloaded" and "cannot start within 20 s" in reply.refused.message
    assert reply.refused.retry_after_s == pytest.approx(15.0)


def test_at_rung_3_a_free_message_that_can_start_in_time_is_admitted():
    generate = service(3, decode_worker("d1", estimated_wait_s=9.0), decode_worker("d2", estimated_wait_s=1.0))
    reply, job = answer(generate, lane=LANE_FREE)
    assert reply.WhichOneof("outcome") == "reply_id"
    assert job.worker_ids[0] == "d2"  # within the free target: offered first


def test_at_rung_0_the_door_refuses_a_lane_every_worker_refused_lately():
    refusals = LaneRefusals()
    generate = service(0, decode_worker("d1"), decode_worker("d2"), refusals=refusals)
    refusals.note("d1", LANE_FREE, 5.0)
    refusals.note("d2", LANE_FREE, 5.0)
    reply, job = answer(generate, lane=LANE_FREE)
    assert job is None and reply.refused.reason == "overloaded"
    assert 0 < reply.refused.retry_after_s <= 5.0
    assert answer(generate, lane=LANE_PAID)[1] is not None


def test_a_continuation_is_never_refused_or_capped_by_the_ladder():
    generate = service(3, decode_worker("d1", estimated_wait_s=60.0))
    reply, job = answer(generate, lane=LANE_FREE, max_tokens=1000, resume_reply_id="r-old", generated_token_ids=[5, 6])
    assert reply.reply_id == "r-old"
    assert job.assignment.request.sampling.max_tokens == 1000
