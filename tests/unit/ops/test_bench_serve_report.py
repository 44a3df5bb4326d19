"""The summary of a `tandem bench serve` run, computed from request results made by hand:
percentiles, throughputs, errors by kind, how output tokens were counted, the table, the JSON
and the plots."""

from __future__ import annotations

import json

import pytest

from tandem.ops.bench_client import RequestResult
from tandem.ops.bench_plots import write_plots
from tandem.ops.bench_report import Distribution, format_table, report_json, summarize, throughput_over_time


def ok(started_s: float, deltas: list[float], output_tokens: int | None = None, prompt_tokens: int | None = None) -> RequestResult:
    counted = output_tokens is not None
    return RequestResult(
        started_s=started_s,
        ok=True,
        ttft_s=deltas[0],
        e2e_s=deltas[-1] + 0.01,
        delta_offsets_s=deltas,
        output_tokens=output_tokens if counted else len(deltas),
        prompt_tokens=prompt_tokens,
        is_usage_counted=counted,
    )


def failed(kind: str) -> RequestResult:
    return RequestResult(started_s=0.0, error=kind, e2e_s=0.05)


def test_percentiles_interpolate_between_ranks_as_numpy_does():
    dist = Distribution.of_seconds([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert dist is not None and dist.num == 100
    assert dist.mean_ms == pytest.approx(50.5)
    assert dist.p50_ms == pytest.approx(50.5)
    assert dist.p95_ms == pytest.approx(95.05)
    assert dist.p99_ms == pytest.approx(99.01)
    assert Distribution.of_seconds([]) is None


def test_the_summary_counts_throughput_latencies_and_errors_by_kind():
    results = [
        ok(0.0, [0.1, 0.2, 0.4], output_tokens=6, prompt_tokens=10),
        ok(0.5, [0.3, 0.35], output_tokens=4, prompt_tokens=20),
        failed("http_429"),
        failed("http_429"),
        failed("connect"),
    ]
    summary = summarize(results, duration_s=2.0)
    assert (summary.num_requests, summary.num_ok, summary.num_failed) == (5, 2, 3)
    assert summary.errors == {"connect": 1, "http_429": 2}
    assert summary.request_throughput == pytest.approx(1.0)
    assert summary.output_throughput == pytest.approx(5.0)  # (6 + 4) / 2 s
    assert summary.total_throughput == pytest.approx(20.0)  # (6 + 4 + 10 + 20) / 2 s
    assert summary.output_tokens_counted_by == "usage"
    assert summary.ttft is not None and summary.ttft.mean_ms == pytest.approx(200.0)
    assert summary.itl is not None and summary.itl.p50_ms == pytest.approx(100.0)
    assert summary.itl.num == 3  # 0.1, 0.2 and 0.05: gaps within each request only
    # TPOT: (e2e - ttft) / (tokens - 1): (0.41 - 0.1) / 5 and (0.36 - 0.3) / 3.
    assert summary.tpot is not None and summary.tpot.mean_ms == pytest.approx((62 + 20) / 2)


def test_output_tokens_fall_back_to_content_deltas_and_say_so():
    assert summarize([ok(0, [0.1, 0.2])], 1.0).output_tokens_counted_by == "deltas"
    assert summarize([ok(0, [0.1, 0.2]), ok(0, [0.1], output_tokens=3)], 1.0).output_tokens_counted_by == "mixed"
    everything_failed = summarize([failed("timeout")], 1.0)
    assert everything_failed.num_ok == 0 and everything_failed.ttft is None and everything_failed.request_throughput == 0
    assert everything_failed.output_tokens_counted_by == "none"


def test_throughput_over_time_bins_each_delta_by_its_arrival():
    results = [ok(0.0, [0.5, 1.5, 2.5], output_tokens=6), ok(1.0, [0.2], output_tokens=1), failed("connect")]
    assert throughput_over_time(results) == [(0.0, 2.0), (1.0, 3.0), (2.0, 2.0)]


def test_the_table_shows_counts_throughput_percentiles_and_errors():
    table = format_table(summarize([ok(0, [0.1, 0.3], output_tokens=2), failed("http_503")], 1.0), "tandem")
    assert "tandem" in table.splitlines()[0]
    assert "Requests ok:" in table and "Requests failed:" in table
    for line in ("Output token throughput (tok/s):", "P99 TTFT (ms):", "Mean ITL (ms):", "P95 E2E (ms):", "http_503:"):
        assert line in table
    ttft_line = next(line for line in table.splitlines() if line.startswith("Mean TTFT"))
    assert ttft_line.split()[-1] == "100.00"


def test_the_json_holds_config_summary_and_every_request():
    results = [ok(0, [0.1, 0.3], output_tokens=2), failed("timeout")]
    report = json.loads(json.dumps(report_json(summarize(results, 1.0), {"seed": 1}, results)))
    assert report["config"] == {"seed": 1}
    assert report["summary"]["num_ok"] == 1 and report["summary"]["errors"] == {"timeout": 1}
    assert report["output_tokens_counted_by"] == "usage"
    assert [r["error"] for r in report["requests"]] == [None, "timeout"]
    assert report["requests"][0]["itls_s"] == [pytest.approx(0.2)]


def test_plots_are_png_files_and_skipped_without_data(tmp_path):
    written = write_plots([ok(0, [0.1, 0.2, 0.35]), ok(0.2, [0.15, 0.3])], tmp_path / "plots", "test")
    assert sorted(p.name for p in written) == ["itl.png", "throughput.png", "ttft.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") and p.stat().st_size > 2000 for p in written)
    assert write_plots([failed("connect")], tmp_path / "none", "test") == []
