"""Lanes at the router: the order workers are offered a request, refusals remembered, the door."""

import pytest
from router_fakes import MODEL, decode_worker, request

from services.router.dispatch import REFUSED, Attempt, DispatchConfig, DispatchResult, failure_event
from services.router.lanes import LaneRefusals, WaitTargets, door_refusal, lane_of, order_for_lane
from tandem.config import Settings
from tandem.v1.common_pb2 import LANE_BACKGROUND, LANE_FREE, LANE_PAID, LANE_UNSPECIFIED
from tandem.v1.dispatch_pb2 import Assignment
from tandem.v1.generate_pb2 import Refusal

TARGETS = WaitTargets(paid_s=1.0, free_s=2.0)


class Clock:
    def __init__(self) -> None:
        self.now_s = 50.0

    def __call__(self) -> float:
        return self.now_s


def ids(workers) -> list[str]:
    return [w.instance_id for w in workers]


def test_an_unset_lane_is_free():
    assert lane_of(request(lane=LANE_UNSPECIFIED)) == LANE_FREE
    assert lane_of(request(lane=LANE_PAID)) == LANE_PAID


def test_targets_are_the_gpu_ones_only_for_a_fleet_said_to_be_cuda():
    assert WaitTargets.from_settings(Settings(device="cuda")) == WaitTargets(paid_s=1.0, free_s=2.0)
    for device in ("cpu", "auto"):  # the router cannot tell: it errs on the long side
        assert WaitTargets.from_settings(Settings(device=device, cpu_ttft_scale=10)) == WaitTargets(paid_s=10.0, free_s=20.0, scale=10)


def test_a_worker_that_states_its_free_target_is_judged_by_it_not_by_the_routers_guess():
    # a CPU worker allowing 20 s, behind a router that guessed a GPU fleet (2 s)
    cpu = decode_worker("cpu", estimated_wait_s=15.0, free_ttft_target_s=20.0)
    gpu = decode_worker("gpu", estimated_wait_s=3.0, free_ttft_target_s=2.0)
    refusals = LaneRefusals(Clock())
    assert ids(order_for_lane([gpu, cpu], LANE_FREE, TARGETS, refusals)) == ["cpu", "gpu"]
    assert door_refusal(LANE_FREE, MODEL, [cpu, gpu], refusals, TARGETS) is None
    assert TARGETS.scale_of(cpu) == pytest.approx(10.0) and TARGETS.scale_of(gpu) == pytest.approx(1.0)
    overdue = door_refusal(LANE_FREE, MODEL, [decode_worker("cpu", estimated_wait_s=26.0, free_ttft_target_s=20.0)], refusals, TARGETS)
    assert overdue is not None and overdue.retry_after_s == pytest.approx(6.0)


def test_free_requests_try_workers_within_the_free_target_first_and_paid_keep_the_ranking():
    ranked = [decode_worker("slow", estimated_wait_s=5.0), decode_worker("fast", estimated_wait_s=1.0)]
    refusals = LaneRefusals(Clock())
    assert ids(order_for_lane(ranked, LANE_FREE, TARGETS, refusals)) == ["fast", "slow"]
    assert ids(order_for_lane(ranked, LANE_BACKGROUND, TARGETS, refusals)) == ["fast", "slow"]
    assert ids(order_for_lane(ranked, LANE_PAID, TARGETS, refusals)) == ["slow", "fast"]


def test_a_worker_that_refused_a_lane_is_offered_it_last_until_its_retry_time():
    clock = Clock()
    refusals = LaneRefusals(clock)
    ranked = [decode_worker("full"), decode_worker("other")]
    refusals.note("full", LANE_FREE, retry_after_s=3.0)
    assert ids(order_for_lane(ranked, LANE_FREE, TARGETS, refusals)) == ["other", "full"]
    assert ids(order_for_lane(ranked, LANE_PAID, TARGETS, refusals)) == ["full", "other"]  # paid was not refused
    assert refusals.eta_s("full", LANE_BACKGROUND) == pytest.approx(3.0)  # behind free: refused too
    clock.now_s += 3.0
    assert ids(order_for_lane(ranked, LANE_FREE, TARGETS, refusals)) == ["full", "other"]


def test_the_door_refuses_a_lane_only_when_every_serving_worker_refused_it_with_the_soonest_eta():
    clock = Clock()
    refusals = LaneRefusals(clock)
    serving = [decode_worker("a"), decode_worker("b")]
    refusals.note("a", LANE_FREE, retry_after_s=4.0)
    assert door_refusal(LANE_FREE, MODEL, serving, refusals, TARGETS) is None
    refusals.note("b", LANE_FREE, retry_after_s=2.5)
    refused = door_refusal(LANE_FREE, MODEL, serving, refusals, TARGETS)
    assert refused is not None
    assert (refused.reason, refused.retry_after_s) == ("overloaded", pytest.approx(2.5))
    assert "free" in refused.message and MODEL in refused.message
    assert door_refusal(LANE_PAID, MODEL, serving, refusals, TARGETS) is None
    clock.now_s += 2.5
    assert door_refusal(LANE_FREE, MODEL, serving, refusals, TARGETS) is None
    refusals.note("a", LANE_FREE, 1.0)
    refusals.forget("b")
    assert door_refusal(LANE_FREE, MODEL, serving, refusals, TARGETS) is None


def test_when_every_worker_says_queue_full_the_reply_ends_overloaded_with_the_soonest_eta():
    assignment = Assignment(reply_id="r1", request=request(), first_seq=1)
    result = DispatchResult(
        (
            Attempt("a", REFUSED, refusal=Refusal(reason="queue_full", message="wait 9 s", retry_after_s=7.0)),
            Attempt("b", REFUSED, refusal=Refusal(reason="queue_full", message="wait 5 s", retry_after_s=3.0)),
        )
    )
    event = failure_event(assignment, result, DispatchConfig())
    assert event.error.code == "overloaded"
    assert event.error.retry_after_s == pytest.approx(3.0)
    assert "a refused (queue_full: wait 9 s)" in result.describe()
    assert "wait 9 s" not in event.error.message


def test_the_door_refuses_free_work_when_every_heartbeat_expects_a_wait_over_the_free_target():
    refusals = LaneRefusals(Clock())
    serving = [decode_worker("a", estimated_wait_s=7.0), decode_worker("b", estimated_wait_s=5.5)]
    refused = door_refusal(LANE_FREE, MODEL, serving, refusals, TARGETS)
    assert refused is not None
    assert refused.reason == "overloaded"
    assert refused.retry_after_s == pytest.approx(3.5)  # b's 5.5 s wait is down to the 2 s target then
    assert door_refusal(LANE_BACKGROUND, MODEL, serving, refusals, TARGETS) is not None
    assert door_refusal(LANE_PAID, MODEL, serving, refusals, TARGETS) is None  # paid goes ahead of that queue
    serving.append(decode_worker("c", estimated_wait_s=1.5))
    assert door_refusal(LANE_FREE, MODEL, serving, refusals, TARGETS) is None
