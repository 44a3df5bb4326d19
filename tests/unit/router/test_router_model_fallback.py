"""Between the large and the small model's pools, through GenerateService.handle: a small-model
request goes large when the small pool is down or full; a large-model request goes small only for
free traffic (the pool down, or the ladder's rung 1); paid never goes small."""

from prometheus_client import REGISTRY
from router_fakes import decode_worker, request

from services.router.dispatch import DispatchConfig
from services.router.generate import GenerateService
from services.router.ladder import FleetReading, Ladder
from services.router.lanes import LaneRefusals
from services.router.overload import Overload
from services.router.placement import Placement
from services.router.pools import ModelPools
from services.router.workers import WorkerRegistry
from tandem.v1.common_pb2 import LANE_BACKGROUND, LANE_FREE, LANE_PAID
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.tokens_pb2 import TokenEvent

LARGE = "SmolLM2-135M-Instruct"
SMALL = "SmolLM2-135M-Instruct-int8"
POOLS = ModelPools(large=LARGE, small=SMALL)
INTERVAL_S = 10.0


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


def service(*workers, pools: ModelPools = POOLS, rung: int = 0, refusals: LaneRefusals | None = None) -> GenerateService:
    registry = WorkerRegistry()
    for worker in workers:
        registry.observe(worker.heartbeat)
    overload = Overload(ladder_at(rung))
    return GenerateService(registry, Placement(), never_called, never_called, DispatchConfig(), overload, refusals=refusals, pools=pools)


def answer(generate: GenerateService, model: str, lane: int = LANE_FREE, **fields):
    return generate.handle(request(model=model, lane=lane, **fields).SerializeToString())


def fallbacks(from_model: str, to_model: str, why: str) -> float:
    labels = {"from_model": from_model, "to_model": to_model, "why": why}
    return REGISTRY.get_sample_value("tandem_router_model_fallbacks_total", labels) or 0.0


def test_each_pool_answers_its_own_model_while_both_take_work():
    generate = service(decode_worker("large-0", model=LARGE), decode_worker("small-0", model=SMALL))
    for model in (LARGE, SMALL):
        reply, job = answer(generate, model)
        assert reply.model == model and job.assignment.request.model == model


def test_auto_is_the_large_model_the_settings_name_even_where_more_workers_serve_the_small_one():
    generate = service(decode_worker("large-0", model=LARGE), decode_worker("small-0", model=SMALL), decode_worker("small-1", model=SMALL))
    assert answer(generate, "auto")[0].model == LARGE


def test_a_small_model_request_with_no_small_worker_live_goes_to_the_large_pool_and_is_counted():
    before = fallbacks(SMALL, LARGE, "down")
    generate = service(decode_worker("large-0", model=LARGE))
    for lane in (LANE_FREE, LANE_PAID):
        reply, job = answer(generate, SMALL, lane)
        assert reply.model == LARGE
        assert job.assignment.request.model == LARGE and job.worker_ids == ("large-0",)
    assert fallbacks(SMALL, LARGE, "down") == before + 2


def test_a_small_pool_that_is_loading_or_draining_counts_as_down():
    generate = service(decode_worker("large-0", model=LARGE), decode_worker("small-0", model=SMALL, is_ready=False))
    assert answer(generate, SMALL)[0].model == LARGE
    generate = service(decode_worker("large-0", model=LARGE), decode_worker("small-0", model=SMALL, is_engine_ready=False))
    assert answer(generate, SMALL)[0].model == LARGE


def test_a_full_small_pool_sends_its_traffic_to_the_large_pool():
    refusals = LaneRefusals()
    generate = service(decode_worker("large-0", model=LARGE), decode_worker("small-0", model=SMALL), refusals=refusals)
    refusals.note("small-0", LANE_PAID, 5.0)  # no room for paid: none for free either
    before = fallbacks(SMALL, LARGE, "full")
    for lane in (LANE_PAID, LANE_FREE):
        reply, job = answer(generate, SMALL, lane)
        assert reply.model == LARGE and job.worker_ids == ("large-0",)
    assert fallbacks(SMALL, LARGE, "full") == before + 2


def test_when_both_pools_are_full_the_small_pools_refusal_stands():
    refusals = LaneRefusals()
    generate = service(decode_worker("large-0", model=LARGE), decode_worker("small-0", model=SMALL), refusals=refusals)
    refusals.note("small-0", LANE_FREE, 3.0)
    refusals.note("large-0", LANE_FREE, 3.0)
    reply, job = answer(generate, SMALL)
    assert job is None and reply.refused.reason == "overloaded" and SMALL in reply.refused.message


def test_a_small_model_request_too_long_for_the_large_window_keeps_its_refusal():
    generate = service(decode_worker("large-0", model=LARGE, max_model_len=64))
    reply, job = answer(generate, SMALL, num_prompt_tokens=100)
    assert job is None and reply.refused.reason == "no_workers"


def test_a_free_large_model_request_goes_small_when_no_large_worker_takes_work_and_paid_never_does():
    generate = service(decode_worker("large-0", model=LARGE, is_ready=False), decode_worker("small-0", model=SMALL))
    before = fallbacks(LARGE, SMALL, "down")
    reply, job = answer(generate, LARGE, LANE_FREE)
    assert reply.model == SMALL and job.worker_ids == ("small-0",)
    assert fallbacks(LARGE, SMALL, "down") == before + 1
    for lane in (LANE_PAID, LANE_BACKGROUND):
        reply, job = answer(generate, LARGE, lane)
        assert job is None and reply.refused.reason == "no_workers"
    reply, job = answer(generate, "auto", LANE_PAID)
    assert job is None and reply.refused.reason == "no_workers"  # a named pool: not an unknown model


def test_a_full_large_pool_sends_free_traffic_small_only_from_the_ladders_first_rung():
    refusals = LaneRefusals()
    workers = (decode_worker("large-0", model=LARGE), decode_worker("small-0", model=SMALL))
    refusals.note("large-0", LANE_FREE, 5.0)
    reply, job = answer(service(*workers, rung=0, refusals=refusals), LARGE)
    assert job is None and reply.refused.reason == "overloaded"
    reply, job = answer(service(*workers, rung=1, refusals=refusals), LARGE)
    assert reply.model == SMALL and job.worker_ids == ("small-0",)
    reply, job = answer(service(*workers, rung=1, refusals=refusals), LARGE, LANE_PAID)
    assert reply.model == LARGE  # paid is never moved to the small model


def test_from_rung_1_free_goes_to_the_small_model_the_settings_name_not_another_served_one():
    workers = (decode_worker("large-0", model=LARGE), decode_worker("other-0", model="other"), decode_worker("other-1", model="other"))
    generate = service(*workers, decode_worker("small-0", model=SMALL), rung=1)
    assert answer(generate, LARGE)[0].model == SMALL


def test_without_both_models_named_nothing_moves():
    generate = service(decode_worker("large-0", model=LARGE), pools=ModelPools())
    reply, job = answer(generate, SMALL)
    assert job is None and reply.refused.reason == "unknown_model"
    generate = service(decode_worker("large-0", model=LARGE), pools=ModelPools(large=LARGE))
    assert answer(generate, SMALL)[0].refused.reason == "unknown_model"


def test_a_continuation_of_a_small_model_reply_whose_pool_is_gone_continues_on_the_large_one():
    generate = service(decode_worker("large-0", model=LARGE))
    reply, job = answer(generate, SMALL, resume_reply_id="r-old", generated_token_ids=[5, 6])
    assert (reply.reply_id, reply.model, job.assignment.first_seq) == ("r-old", LARGE, 3)


async def test_a_reply_every_small_worker_refuses_as_full_is_placed_on_the_large_pool():
    offers: list[tuple[str, str]] = []

    async def assign(worker_id: str, assignment: Assignment) -> AssignmentReply:
        offers.append((worker_id, assignment.request.model))
        if worker_id.startswith("small"):
            return AssignmentReply(refused={"reason": "queue_full", "retry_after_s": 3.0})
        return AssignmentReply(accepted=True)

    registry = WorkerRegistry()
    for worker in (decode_worker("large-0", model=LARGE), decode_worker("small-0", model=SMALL), decode_worker("small-1", model=SMALL)):
        registry.observe(worker.heartbeat)
    generate = GenerateService(registry, Placement(), assign, never_called, DispatchConfig(), pools=POOLS)
    before = fallbacks(SMALL, LARGE, "full")
    reply, job = answer(generate, SMALL)
    assert reply.model == SMALL
    await generate.dispatch(job)
    assert sorted(offers[:2]) == [("small-0", SMALL), ("small-1", SMALL)]
    assert offers[2:] == [("large-0", LARGE)], "then the large pool, with the request naming its model"
    assert fallbacks(SMALL, LARGE, "full") == before + 1


async def test_a_small_worker_that_is_gone_rather_than_full_does_not_move_the_reply():
    offers: list[str] = []

    async def assign(worker_id: str, assignment: Assignment) -> AssignmentReply:
        offers.append(worker_id)
        return AssignmentReply(refused={"reason": "draining"}) if worker_id == "small-0" else AssignmentReply(accepted=True)

    published: list[TokenEvent] = []

    async def publish(event: TokenEvent) -> None:
        published.append(event)

    registry = WorkerRegistry()
    for worker in (decode_worker("large-0", model=LARGE), decode_worker("small-0", model=SMALL)):
        registry.observe(worker.heartbeat)
    generate = GenerateService(registry, Placement(), assign, publish, DispatchConfig(), pools=POOLS)
    _, job = answer(generate, SMALL)
    await generate.dispatch(job)
    assert offers == ["small-0"]
    assert [event.error.code for event in published] == ["draining"], "the reply ends, as before, with the worker's reason"
