"""The automatic rollback over a window of ReplyOutcomes: a candidate failing more than the stable
(by the error margin) or slower at TTFT p95 (by the TTFT margin) is rolled back once it has enough
replies; its applied share goes to 0, counted, published in RolloutStatus; another router's
rollback is adopted; a changed rollout file ends it."""

import logging

import pytest
from prometheus_client import REGISTRY

from services.router.rollback import RollbackRule
from services.router.rollout import ModelRollout, RolloutPlan
from services.router.rollout_state import Rollouts
from services.router.versions import VersionPicker
from tandem.v1.worker_pb2 import ReplyOutcome

SMOL = ModelRollout("smol", stable="1", candidate="2", candidate_percent=10.0, shadow_percent=5.0)
RULE = RollbackRule(window_s=60.0, min_replies=10, error_margin=0.05, ttft_margin=0.5)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def rollouts(clock: Clock, plan: RolloutPlan = RolloutPlan({"smol": SMOL})) -> Rollouts:
    state = Rollouts(RULE, clock=clock, wall_ms=lambda: 1_700_000_000_000)
    state.set_plan(plan)
    return state


def outcome(model: str, *, ttft_s: float = 0.2, is_error: bool = False, is_shadow: bool = False) -> ReplyOutcome:
    return ReplyOutcome(reply_id="r1", model=model, ttft_s=ttft_s, is_error=is_error, is_shadow=is_shadow)


def feed(state: Rollouts, model: str, num: int, **fields):
    return [state.observe(outcome(model, **fields)) for _ in range(num)]


def rollbacks(reason: str) -> float:
    labels = {"model": "smol", "version": "2", "reason": reason}
    return REGISTRY.get_sample_value("tandem_router_rollbacks_total", labels) or 0.0


def percent(version: str) -> float | None:
    return REGISTRY.get_sample_value("tandem_router_rollout_percent", {"model": "smol", "version": version})


def test_a_candidate_failing_more_than_the_stable_is_rolled_back_once_it_has_enough_replies(caplog):
    clock = Clock()
    state = rollouts(clock)
    assert (percent("1"), percent("2")) == (90.0, 10.0)
    feed(state, "smol@1", 20)
    before = rollbacks("error_rate")
    with caplog.at_level(logging.WARNING, logger="services.router.rollout_state"):
        verdicts = feed(state, "smol@2", 9, is_error=True)
        assert verdicts == [None] * 9, "under min_replies: no rollback whatever the errors"
        assert state.applied("smol") == SMOL
        found = state.observe(outcome("smol@2", is_error=True))
    assert found is not None and found.reason == "error_rate"
    assert state.applied("smol") == ModelRollout("smol", "1", "2", 0.0, 0.0)
    assert rollbacks("error_rate") == before + 1
    assert (percent("1"), percent("2")) == (100.0, 0.0)
    assert "rolled back smol@2 (its share of smol is 0 now): error rate 1.00 > stable 0.00 + 0.05" in caplog.text
    status = state.status("router-1", 2.0).models[0]
    assert (status.rolled_back, status.configured_percent, status.candidate_percent, status.shadow_percent) == (True, 10.0, 0.0, 0.0)
    assert status.rollback_reason.startswith("error rate 1.00 > stable 0.00")
    assert (status.candidate_window.replies, status.candidate_window.errors, status.stable_window.replies) == (10, 10, 20)
    assert status.rolled_back_unix_ms == 1_700_000_000_000
    assert feed(state, "smol@2", 5, is_error=True) == [None] * 5, "rolled back once, counted once"


def test_errors_within_the_margin_and_outside_the_window_do_not_roll_back():
    clock = Clock()
    state = rollouts(clock)
    feed(state, "smol@1", 20)
    feed(state, "smol@2", 9, is_error=True)
    clock.now_s += RULE.window_s + 1  # those fell out of the window
    feed(state, "smol@2", 19)
    assert state.observe(outcome("smol@2", is_error=True)) is None, "1/20 = 0.05 is not above 0.05 + the stable's 0"
    feed(state, "smol@1", 20, is_error=True)  # the stable fails as much
    assert feed(state, "smol@2", 20, is_error=True) == [None] * 20, "21/40 is not above the stable's 20/20"
    assert feed(state, "smol@2", 20, is_error=True, is_shadow=True) == [None] * 20, "shadow replies are not compared"
    assert state.applied("smol").candidate_percent == 10.0


def test_a_candidate_slower_at_ttft_p95_is_rolled_back():
    state = rollouts(Clock())
    feed(state, "smol@1", 20, ttft_s=0.2)
    feed(state, "smol@2", 9, ttft_s=0.29)  # within 50 %
    assert state.observe(outcome("smol@2", ttft_s=0.29)) is None
    before = rollbacks("ttft")
    found = [v for v in feed(state, "smol@2", 20, ttft_s=0.5) if v is not None]
    assert [v.reason for v in found] == ["ttft"]
    assert found[0].message.startswith("TTFT p95 0.500 s > stable 0.200 s x 1.5")
    assert rollbacks("ttft") == before + 1
    assert state.status("router-1", 2.0).models[0].candidate_window.ttft_p95_s == pytest.approx(0.5)


def test_a_rollback_another_router_announced_is_adopted_for_the_same_entry_only():
    announcer = rollouts(Clock())
    feed(announcer, "smol@2", 10, is_error=True)
    announced = announcer.status("router-1", 2.0)
    assert announced.models[0].rolled_back
    same = rollouts(Clock())
    assert same.adopt(announced) == ["smol"]
    assert same.applied("smol").candidate_percent == 0.0
    assert same.status("router-2", 2.0).models[0].rollback_reason == announced.models[0].rollback_reason
    other_entry = rollouts(Clock(), RolloutPlan({"smol": ModelRollout("smol", "1", "3", 10.0)}))
    assert other_entry.adopt(announced) == [], "another candidate: not this router's rollout"
    edited = rollouts(Clock(), RolloutPlan({"smol": ModelRollout("smol", "1", "2", 20.0)}))
    assert edited.adopt(announced) == [], "the same candidate, re-enabled by an edit the announcer has not read yet"
    assert edited.applied("smol").candidate_percent == 20.0


def test_a_changed_file_ends_the_rollback_and_the_candidate_starts_afresh():
    state = rollouts(Clock())
    feed(state, "smol@2", 10, is_error=True)
    state.set_plan(RolloutPlan({"smol": SMOL}))
    assert state.applied("smol").candidate_percent == 0.0, "the same entry: the rollback holds"
    state.set_plan(RolloutPlan({"smol": ModelRollout("smol", "1", "2", 1.0)}))
    assert state.applied("smol").candidate_percent == 1.0
    assert state.status("router-1", 2.0).models[0].candidate_window.replies == 0
    assert state.observe(outcome("smol@2", is_error=True)) is None, "judged on its new replies"
    state.set_plan(RolloutPlan())
    assert percent("1") is None and percent("2") is None, "a model gone from the file leaves the gauge"


def test_replies_the_candidates_workers_refused_count_as_its_errors_unless_they_were_only_full():
    state = rollouts(Clock())
    picker = VersionPicker(state)
    feed(state, "smol@1", 20)
    for i in range(RULE.min_replies):
        picker.refused_at_placement("smol@2", f"full{i}", "queue_full")  # load, not a fault
    assert state.applied("smol").candidate_percent == 10.0
    for i in range(RULE.min_replies):
        picker.refused_at_placement("smol@2", f"bad{i}", "bad_request")
    assert state.applied("smol").candidate_percent == 0.0
