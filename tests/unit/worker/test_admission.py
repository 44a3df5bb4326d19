"""Admission by expected wait, with injected numbers: what counts as ahead of a request by lane,
when a worker refuses ("queue_full") and what retry_after_s it names."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.config import Settings
from tandem.engine.sequence import Lane
from tandem.worker.admission import MIN_RETRY_AFTER_S, QueueState, TtftTargets, queue_verdict

TARGETS = TtftTargets(paid_s=1.0, free_s=2.0)


def state(
    rate: float = 1000.0,
    paid: int = 0,
    free: int = 0,
    background: int = 0,
    running_prefill: dict[Lane, int] | None = None,
    free_blocks: int = 1000,
    running_blocks: dict[Lane, int] | None = None,
    idle: bool = False,
) -> QueueState:
    return QueueState(
        prefill_tokens_per_s=rate,
        waiting_prefill_tokens={Lane.PAID: paid, Lane.FREE: free, Lane.BACKGROUND: background},
        running_prefill_tokens=running_prefill or {Lane.PAID: 0, Lane.FREE: 0, Lane.BACKGROUND: 0},
        num_free_blocks=free_blocks,
        running_blocks=running_blocks or {Lane.PAID: 0, Lane.FREE: 0, Lane.BACKGROUND: 0},
        block_size=16,
        has_idle_capacity=idle,
    )


def test_paid_work_is_ahead_of_everyone_free_work_only_of_free_and_background():
    s = state(rate=1000, paid=500, free=3000, background=7000, running_prefill={Lane.PAID: 100, Lane.FREE: 100, Lane.BACKGROUND: 0})
    assert s.estimated_wait_s(Lane.PAID) == pytest.approx(0.6)  # the running free prefill computes nothing while paid waits
    assert s.estimated_wait_s(Lane.FREE) == pytest.approx(3.7)
    assert s.estimated_wait_s(Lane.BACKGROUND) == pytest.approx(10.7)


def test_running_unpaid_prefills_do_not_make_a_paid_request_wait_but_do_make_a_free_one():
    """Nine free prompts half-prefilled under a cap of unpaid rows a step: a paid request offered
    now gets the next step to itself, so it is taken; a free one would wait behind them."""
    s = state(rate=1000, running_prefill={Lane.PAID: 0, Lane.FREE: 4500, Lane.BACKGROUND: 0})
    assert queue_verdict(s, Lane.PAID, 100, TARGETS) is None
    assert queue_verdict(s, Lane.FREE, 100, TARGETS) is not None
    paid_running = state(rate=1000, running_prefill={Lane.PAID: 1500, Lane.FREE: 0, Lane.BACKGROUND: 0})
    assert queue_verdict(paid_running, Lane.PAID, 100, TARGETS) is not None  # running paid prefills do go first


def test_no_wait_is_estimated_before_a_prefill_rate_is_measured():
    assert state(rate=0.0, free=10**6).estimated_wait_s(Lane.FREE) is None


def test_a_free_request_that_would_wait_past_its_target_is_refused_with_the_time_until_it_would_fit():
    verdict = queue_verdict(state(rate=1000, free=5000), Lane.FREE, 100, TARGETS)
    assert verdict is not None
    assert verdict.retry_after_s == pytest.approx(3.0)  # 5 s of work ahead, 2 s allowed
    assert "5.0 s" in verdict.message


def test_the_same_queue_refuses_free_but_takes_paid_which_only_waits_for_paid_work():
    s = state(rate=1000, paid=300, free=5000)
    assert queue_verdict(s, Lane.FREE, 100, TARGETS) is not None
    assert queue_verdict(s, Lane.PAID, 100, TARGETS) is None


def test_a_wait_within_the_target_is_taken():
    assert queue_verdict(state(rate=1000, free=1900), Lane.FREE, 100, TARGETS) is None


def test_a_retry_is_never_asked_sooner_than_the_minimum():
    verdict = queue_verdict(state(rate=1000, free=2001), Lane.FREE, 100, TARGETS)
    assert verdict is not None and verdict.retry_after_s == MIN_RETRY_AFTER_S


def test_without_a_measured_rate_a_long_queue_is_no_reason_to_refuse():
    assert queue_verdict(state(rate=0.0, paid=10**6, free=10**6, free_blocks=10**6), Lane.FREE, 100, TARGETS) is None


def test_free_blocks_short_of_the_queued_prompts_are_no_reason_to_refuse_paid_or_free_work():
    # Blocks come back as running replies end; only the wait decides.
    s = state(rate=1000, free=16 * 8, free_blocks=2, running_blocks={Lane.PAID: 0, Lane.FREE: 40, Lane.BACKGROUND: 0})
    assert queue_verdict(s, Lane.FREE, 16 * 20, TARGETS) is None
    assert queue_verdict(s, Lane.PAID, 16 * 20, TARGETS) is None


def test_the_kv_can_hold_a_request_after_the_work_ahead_counting_lower_lanes_that_give_way():
    s = state(free=16 * 8, free_blocks=10, running_blocks={Lane.PAID: 0, Lane.FREE: 30, Lane.BACKGROUND: 10})
    assert s.can_hold(Lane.FREE, 16 * 12)  # 8 ahead + 12 <= 10 free + 10 background
    assert not s.can_hold(Lane.FREE, 16 * 12 + 1)
    assert s.can_hold(Lane.PAID, 16 * 40)  # nothing paid waits; 10 free + 40 lower-lane blocks


def test_background_work_is_taken_only_on_idle_capacity_that_can_hold_it():
    assert queue_verdict(state(idle=True), Lane.BACKGROUND, 100, TARGETS) is None
    verdict = queue_verdict(state(idle=False, paid=3000), Lane.BACKGROUND, 100, TARGETS)
    assert verdict is not None and verdict.retry_after_s == pytest.approx(3.0)
    running = {Lane.PAID: 0, Lane.FREE: 4, Lane.BACKGROUND: 0}
    assert queue_verdict(state(idle=True, free_blocks=6, running_blocks=running), Lane.BACKGROUND, 16 * 7, TARGETS) is not None


def test_targets_are_scaled_on_a_cpu_only():
    settings = Settings(ttft_target_paid_s=1.0, ttft_target_free_s=2.0, cpu_ttft_scale=10.0)
    assert TtftTargets.from_settings(settings, "cpu") == TtftTargets(10.0, 20.0)
    assert TtftTargets.from_settings(settings, "cuda") == TtftTargets(1.0, 2.0)
    assert TtftTargets(1.0, 2.0).for_lane(Lane.BACKGROUND) is None


def test_requests_queued_behind_a_slow_drain_are_refused_though_their_prompts_are_short():
    """KV full of decoding replies: 30 short prompts wait for 30 replies to end (1 admitted per
    second), not for 30 x 50 tokens of prefill (1.5 s at the prefill rate)."""
    s = replace(
        state(rate=1000, free=1500), waiting_seqs={Lane.PAID: 0, Lane.FREE: 30, Lane.BACKGROUND: 0}, admissions_per_s={Lane.FREE: 1.0}
    )
    assert s.estimated_wait_s(Lane.FREE) == pytest.approx(30.0)
    assert s.estimated_wait_s(Lane.PAID) == pytest.approx(0.0)
    verdict = queue_verdict(s, Lane.FREE, 50, TARGETS)
    assert verdict is not None and verdict.retry_after_s == pytest.approx(28.0)
    assert "30 requests ahead, free ones admitted at 1.0/s" in verdict.message
    assert queue_verdict(s, Lane.PAID, 50, TARGETS) is None


def test_the_admission_rate_alone_estimates_a_wait_before_a_prefill_rate_is_measured():
    s = replace(
        state(rate=0.0), waiting_seqs={Lane.PAID: 2, Lane.FREE: 4, Lane.BACKGROUND: 0}, admissions_per_s={Lane.PAID: 4.0, Lane.FREE: 2.0}
    )
    assert s.estimated_wait_s(Lane.PAID) == pytest.approx(0.5)
    assert s.estimated_wait_s(Lane.FREE) == pytest.approx(3.0)  # paid and free ahead, at the free lane's rate
    assert s.estimated_wait_s(Lane.BACKGROUND) is None  # not measured
