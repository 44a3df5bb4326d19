"""`tandem top`'s frame, rendered from fixed /metrics texts: the figures read from the documented
metric names, rates over the interval between two snapshots, histogram percentiles as
Prometheus computes them, and "-" for what a process does not export."""

from __future__ import annotations

import pytest

from tandem.ops.top_frame import Metrics, Snapshot, WorkerView, bucket_quantile, render_frame, windowed_quantile


def worker_text(generated: int, kv: float = 0.25) -> str:
    return f"""\
# TYPE tandem_worker_requests_running gauge
tandem_worker_requests_running{{role="decode",model="m",lane="paid"}} 2
tandem_worker_requests_running{{role="decode",model="m",lane="free"}} 1
# TYPE tandem_worker_requests_waiting gauge
tandem_worker_requests_waiting{{role="decode",model="m",lane="free"}} 4
# TYPE tandem_worker_kv_cache_usage_ratio gauge
tandem_worker_kv_cache_usage_ratio{{role="decode",model="m"}} {kv}
# TYPE tandem_worker_prefix_cache_queries_tokens_total counter
tandem_worker_prefix_cache_queries_tokens_total{{role="decode",model="m"}} 400
# TYPE tandem_worker_prefix_cache_hits_tokens_total counter
tandem_worker_prefix_cache_hits_tokens_total{{role="decode",model="m"}} 100
# TYPE tandem_worker_generation_tokens_total counter
tandem_worker_generation_tokens_total{{role="decode",model="m"}} {generated}
"""


def chat_text(output_tokens: int, ttft_counts: tuple[int, int, int, int]) -> str:
    b1, b2, b3, inf = ttft_counts
    return f"""\
# TYPE tandem_chat_streams_open gauge
tandem_chat_streams_open 3
# TYPE tandem_chat_output_tokens_total counter
tandem_chat_output_tokens_total{{tier="plus",model="m"}} {output_tokens}
# TYPE tandem_chat_time_to_first_token_seconds histogram
tandem_chat_time_to_first_token_seconds_bucket{{tier="plus",model="m",le="0.1"}} {b1}
tandem_chat_time_to_first_token_seconds_bucket{{tier="plus",model="m",le="0.5"}} {b2}
tandem_chat_time_to_first_token_seconds_bucket{{tier="plus",model="m",le="1.0"}} {b3}
tandem_chat_time_to_first_token_seconds_bucket{{tier="plus",model="m",le="+Inf"}} {inf}
tandem_chat_time_to_first_token_seconds_count{{tier="plus",model="m"}} {inf}
tandem_chat_time_to_first_token_seconds_sum{{tier="plus",model="m"}} 1.0
"""


def snapshot(taken_s: float, generated: int, output_tokens: int, ttft_counts: tuple[int, int, int, int]) -> Snapshot:
    decode = WorkerView("decode", "decode-0", True, 0.4, Metrics.parse(worker_text(generated)))
    prefill = WorkerView("prefill", "prefill-0", False, None, None)  # its /metrics could not be read
    return Snapshot(taken_s, Metrics.parse(chat_text(output_tokens, ttft_counts)), Metrics.parse(""), [prefill, decode], ["x: down"])


def test_bucket_quantile_interpolates_inside_the_bucket_like_prometheus():
    buckets = {0.1: 10.0, 0.5: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 40 / 80)
    assert bucket_quantile(0.95, buckets) == pytest.approx(0.5 + 0.5 * 5 / 10)
    assert bucket_quantile(0.05, buckets) == pytest.approx(0.05)
    assert bucket_quantile(0.99, {0.1: 1.0, float("inf"): 10.0}) == 0.1  # in +Inf: the highest finite bound
    assert bucket_quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


def test_percentiles_cover_the_last_interval_when_it_saw_observations():
    before = Metrics.parse(chat_text(0, (10, 10, 10, 10)))  # ten fast ones earlier
    now = Metrics.parse(chat_text(0, (10, 10, 20, 20)))  # then ten between 0.5 and 1 s
    name = "tandem_chat_time_to_first_token_seconds"
    assert windowed_quantile(0.5, name, now, before) == pytest.approx(0.75)
    assert windowed_quantile(0.5, name, now, None) == pytest.approx(0.1)  # since start
    assert windowed_quantile(0.5, name, now, now) == pytest.approx(0.1)  # a quiet interval: since start


def test_a_frame_shows_workers_rates_and_percentiles():
    before = snapshot(1000.0, generated=100, output_tokens=50, ttft_counts=(0, 0, 0, 0))
    now = snapshot(1002.0, generated=180, output_tokens=130, ttft_counts=(0, 10, 10, 10))
    frame = render_frame(now, before, interval_s=2.0)
    lines = frame.splitlines()
    assert lines[0] == "tandem top  1970-01-01 00:16:42 UTC  (every 2 s)"
    chat = next(line for line in lines if line.startswith("chat"))
    assert "streams open 3" in chat and "output tok/s 40.0" in chat and "TTFT p95 480 ms" in chat
    assert "replies/s -" in chat and "ITL p95 -" in chat  # not exported by this chat: "-"
    decode = next(line for line in lines if line.startswith("decode")).split()
    assert decode == ["decode", "decode-0", "yes", "25.0%", "3", "4", "40.0", "25%", "-"]
    prefill = next(line for line in lines if line.startswith("prefill")).split()
    assert prefill == ["prefill", "prefill-0", "no", "-", "-", "-", "-", "-", "-"]
    assert lines.index(next(line for line in lines if line.startswith("decode"))) < lines.index(
        next(line for line in lines if line.startswith("prefill"))
    )
    assert "queues  waiting: decode 4" in lines
    assert lines[-1] == "!       x: down"


def test_the_first_frame_has_no_rates_yet_and_no_workers_says_so():
    first = snapshot(1000.0, generated=100, output_tokens=50, ttft_counts=(0, 10, 10, 10))
    chat = next(line for line in render_frame(first).splitlines() if line.startswith("chat"))
    assert "output tok/s -" in chat and "TTFT p95 480 ms" in chat
    empty = render_frame(Snapshot(0.0, None, None, []))
    assert "(no workers listed)" in empty and "streams open -" in empty and "ladder rung -" in empty
