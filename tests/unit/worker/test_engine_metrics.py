"""A worker's engine metrics from the engine's stats: gauges set, counters grown by what changed,
each step's time under its kind, queue waits by lane; and the cost per million output tokens over
a recent window, on an injected clock."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from tandem.engine.engine import EngineStats, QueueWait
from tandem.engine.scheduler import SchedulerStats
from tandem.engine.sequence import Lane
from tandem.worker.engine_metrics import EngineMetrics, HandoffMetrics, OutputRate, cost_per_million_tokens


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def scheduler_stats(**changes: object) -> SchedulerStats:
    lanes = dict.fromkeys(Lane, 0)
    stats = SchedulerStats(
        num_running=lanes,
        num_waiting=lanes,
        num_free_blocks=100,
        num_cached_blocks=0,
        num_used_blocks=0,
        num_prefix_hit_tokens=0,
        num_preemptions=0,
        num_queued_prefill_tokens=0,
        num_waiting_prefill_tokens=lanes,
        num_running_prefill_tokens=lanes,
        num_running_blocks=lanes,
        has_idle_capacity=True,
        num_blocks=100,
    )
    return replace(stats, **changes)


def engine_stats(scheduler: SchedulerStats, **counts: float) -> EngineStats:
    fields = dict(num_steps=0, num_prefill_tokens=0, num_decode_tokens=0, prefill_time_s=0.0, decode_time_s=0.0, num_generated_tokens=0)
    fields.update(counts)
    return EngineStats(scheduler, **fields)  # type: ignore[arg-type]


def value(name: str, **labels: str) -> float:
    found = REGISTRY.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_counters_grow_by_what_changed_and_each_step_lands_under_its_kind():
    model = f"m-{uuid.uuid4().hex[:8]}"
    labels = {"role": "decode", "model": model}
    engine_metrics = EngineMetrics("decode", model, worker_hour_cost=2.0)
    engine_metrics.observe(engine_stats(scheduler_stats()))
    running = {**dict.fromkeys(Lane, 0), Lane.PAID: 2}
    prefilled = engine_stats(
        scheduler_stats(
            num_running=running, num_used_blocks=30, num_prefix_query_tokens=200, num_prefix_hit_tokens=64, num_queued_prefill_tokens=70
        ),
        num_steps=1,
        num_prefill_tokens=136,
        prefill_time_s=0.5,
        num_generated_tokens=2,
    )
    engine_metrics.observe(
        prefilled, [QueueWait(Lane.PAID, 0.2), QueueWait(Lane.PAID, 0.3), QueueWait(Lane.FREE, 0.7, until="first_token")]
    )
    decoded = engine_stats(
        replace(prefilled.scheduler, num_preemptions=1),
        num_steps=2,
        num_prefill_tokens=136,
        num_decode_tokens=2,
        prefill_time_s=0.5,
        decode_time_s=0.04,
        num_generated_tokens=4,
        num_cut_steps=3,
    )
    engine_metrics.observe(decoded)
    engine_metrics.observe(decoded)  # a change without a step: nothing counts twice

    assert value("tandem_worker_requests_running", **labels, lane="paid") == 2
    assert value("tandem_worker_kv_cache_usage_ratio", **labels) == pytest.approx(0.3)
    assert value("tandem_worker_queued_prefill_tokens", **labels) == 70
    assert value("tandem_worker_prefix_cache_queries_tokens_total", **labels) == 200
    assert value("tandem_worker_prefix_cache_hits_tokens_total", **labels) == 64
    assert value("tandem_worker_prompt_tokens_total", **labels) == 136
    assert value("tandem_worker_generation_tokens_total", **labels) == 4
    assert value("tandem_worker_preemptions_total", **labels) == 1
    assert value("tandem_worker_steps_cut_total", **labels) == 3
    assert value("tandem_worker_step_seconds_count", **labels, kind="prefill") == 1
    assert value("tandem_worker_step_seconds_sum", **labels, kind="prefill") == pytest.approx(0.5)
    assert value("tandem_worker_step_seconds_sum", **labels, kind="decode") == pytest.approx(0.04)
    assert value("tandem_worker_step_seconds_count", **labels, kind="mixed") == 0
    assert value("tandem_worker_queue_wait_seconds_count", **labels, lane="paid") == 2
    assert value("tandem_worker_queue_wait_seconds_sum", **labels, lane="paid") == pytest.approx(0.5)
    assert value("tandem_worker_queue_wait_seconds_count", **labels, lane="free") == 0
    assert value("tandem_worker_time_to_first_token_seconds_sum", **labels, lane="free") == pytest.approx(0.7)
    assert value("tandem_worker_time_to_first_token_seconds_count", **labels, lane="paid") == 0
    assert value("tandem_worker_cost_per_hour", **labels) == 2.0


def test_the_output_rate_covers_the_window_and_falls_to_zero_when_idle():
    clock = Clock()
    rate = OutputRate(window_s=300, resolution_s=1, clock=clock)
    for second in range(1, 61):  # 10 tokens a second for a minute
        clock.now_s = 1000.0 + second
        rate.add(10 * second)
    assert rate.tokens_per_s() == pytest.approx(10.0)
    clock.now_s += 240  # four idle minutes: the window still holds the minute's 600 tokens
    assert rate.tokens_per_s() == pytest.approx(600 / 300)
    clock.now_s += 61  # the minute has left the window
    assert rate.tokens_per_s() == 0.0
    for second in range(1, 11):  # a burst after a long idle counts against the window, not the idle
        clock.now_s += 1
        rate.add(600 + 50 * second)
    assert rate.tokens_per_s() == pytest.approx(500 / 300)


def test_cost_per_million_tokens_is_the_hour_cost_over_the_hour_output_and_zero_when_unknown():
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)  # 3.6 M tokens an hour
    assert cost_per_million_tokens(0.0, 1000.0) == 0.0
    assert cost_per_million_tokens(3.6, 0.0) == 0.0


def test_the_cost_gauge_reads_the_rate_at_scrape_time():
    model = f"m-{uuid.uuid4().hex[:8]}"
    clock = Clock()
    engine_metrics = EngineMetrics("decode", model, worker_hour_cost=3.6, output_rate=OutputRate(clock=clock))
    clock.now_s += 100
    engine_metrics.observe(engine_stats(scheduler_stats(), num_generated_tokens=100_000))
    assert value("tandem_worker_cost_per_million_output_tokens", role="decode", model=model) == pytest.approx(1.0)


def test_a_handoff_counts_bytes_and_time_when_it_completes_and_only_its_outcome_when_it_fails():
    model = f"m-{uuid.uuid4().hex[:8]}"
    handoffs = HandoffMetrics("prefill", model)
    handoffs.completed("send", 4096, 0.01)
    handoffs.failed("send", "timeout")
    labels = {"role": "prefill", "model": model, "side": "send"}
    assert value("tandem_worker_kv_handoffs_total", **labels, outcome="ok") == 1
    assert value("tandem_worker_kv_handoffs_total", **labels, outcome="timeout") == 1
    assert value("tandem_worker_kv_handoff_bytes_total", **labels) == 4096
    assert value("tandem_worker_kv_handoff_seconds_count", **labels) == 1
