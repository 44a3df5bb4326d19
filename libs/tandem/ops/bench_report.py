"""What a `tandem bench serve` run measured: the summary (throughput, TTFT / ITL / TPOT / e2e
percentiles, errors by kind), printed as a table and written as JSON."""

from __future__ import annotations

import collections
import math
from dataclasses import asdict, dataclass

import numpy as np

from tandem.ops.bench_client import RequestResult

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Distribution:
    """Milliseconds: mean and percentiles (linear interpolation between the closest ranks)."""

    num: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float

    @classmethod
    def of_seconds(cls, values_s: list[float]) -> Distribution | None:
        if not values_s:
            return None
        values_ms = np.asarray(values_s, dtype=np.float64) * 1000
        p50, p95, p99 = (float(v) for v in np.percentile(values_ms, PERCENTILES))
        return cls(len(values_s), float(values_ms.mean()), p50, p95, p99)


@dataclass(frozen=True)
class BenchSummary:
    num_requests: int
    num_ok: int
    num_failed: int
    duration_s: float
    request_throughput: float  # ok requests per second
    output_throughput: float  # output tokens per second
    total_throughput: float  # prompt + output tokens per second (prompt tokens where the server told them)
    total_output_tokens: int
    total_prompt_tokens: int
    output_tokens_counted_by: str  # "usage" (the server's), "deltas" (content chunks), "mixed" or "none" (no request ok)
    ttft: Distribution | None
    itl: Distribution | None
    tpot: Distribution | None  # (e2e - TTFT) / (output tokens - 1), per request
    e2e: Distribution | None
    errors: dict[str, int]


def _counted_by(ok: list[RequestResult]) -> str:
    num_usage = sum(r.is_usage_counted for r in ok)
    if not ok:
        return "none"
    return "usage" if num_usage == len(ok) else "deltas" if num_usage == 0 else "mixed"


def summarize(results: list[RequestResult], duration_s: float) -> BenchSummary:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    tpots = [(r.e2e_s - (r.ttft_s or 0)) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return BenchSummary(
        num_requests=len(results),
        num_ok=len(ok),
        num_failed=len(results) - len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        output_throughput=output_tokens * per_s,
        total_throughput=(output_tokens + prompt_tokens) * per_s,
        total_output_tokens=output_tokens,
        total_prompt_tokens=prompt_tokens,
        output_tokens_counted_by=_counted_by(ok),
        ttft=Distribution.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=Distribution.of_seconds([itl for r in ok for itl in r.itls_s]),
        tpot=Distribution.of_seconds(tpots),
        e2e=Distribution.of_seconds([r.e2e_s for r in ok]),
        errors=dict(sorted(collections.Counter(r.error for r in results if r.error).items())),
    )


def throughput_over_time(results: list[RequestResult], bin_s: float = 1.0) -> list[tuple[float, float]]:
    """(bin start in s from the run's start, output tokens/s in that bin): each content delta of an
    ok request counts its share of the request's output tokens."""
    counts: dict[int, float] = collections.defaultdict(float)
    for r in results:
        if r.ok and r.delta_offsets_s:
            tokens_per_delta = r.output_tokens / len(r.delta_offsets_s)
            for offset_s in r.delta_offsets_s:
                counts[math.floor((r.started_s + offset_s) / bin_s)] += tokens_per_delta
    if not counts:
        return []
    return [(i * bin_s, counts.get(i, 0) / bin_s) for i in range(max(counts) + 1)]


def _row(name: str, value: str) -> str:
    return f"{name:<40}{value:>14}"


def format_table(summary: BenchSummary, title: str) -> str:
    lines = [f"{f' {title} ':=^54}"]
    lines += [
        _row("Requests ok:", str(summary.num_ok)),
        _row("Requests failed:", str(summary.num_failed)),
        _row("Duration (s):", f"{summary.duration_s:.2f}"),
        _row("Prompt tokens (server's count):", str(summary.total_prompt_tokens)),
        _row(f"Output tokens (by {summary.output_tokens_counted_by}):", str(summary.total_output_tokens)),
        _row("Request throughput (req/s):", f"{summary.request_throughput:.2f}"),
        _row("Output token throughput (tok/s):", f"{summary.output_throughput:.2f}"),
        _row("Total token throughput (tok/s):", f"{summary.total_throughput:.2f}"),
    ]
    for label, short, dist in (
        ("Time to first token", "TTFT", summary.ttft),
        ("Inter-token latency", "ITL", summary.itl),
        ("Time per output token", "TPOT", summary.tpot),
        ("End-to-end latency", "E2E", summary.e2e),
    ):
        lines.append(f"{f' {label} ':-^54}")
        if dist is None:
            lines.append(_row("(no data)", "-"))
            continue
        lines.append(_row(f"Mean {short} (ms):", f"{dist.mean_ms:.2f}"))
        for p in PERCENTILES:
            lines.append(_row(f"P{p} {short} (ms):", f"{getattr(dist, f'p{p}_ms'):.2f}"))
    if summary.errors:
        lines.append(f"{' Errors ':-^54}")
        lines += [_row(f"{kind}:", str(num)) for kind, num in summary.errors.items()]
    lines.append("=" * 54)
    return "\n".join(lines)


def report_json(summary: BenchSummary, config: dict[str, object], results: list[RequestResult]) -> dict[str, object]:
    """The run's settings, its summary and every request, for comparing runs later."""
    return {
        "config": config,
        "summary": asdict(summary),
        "output_tokens_counted_by": summary.output_tokens_counted_by,
        "requests": [
            {
                "ok": r.ok,
                "error": r.error,
                "started_s": round(r.started_s, 6),
                "ttft_s": r.ttft_s,
                "e2e_s": r.e2e_s,
                "output_tokens": r.output_tokens,
                "prompt_tokens": r.prompt_tokens,
                "is_usage_counted": r.is_usage_counted,
                "retry_after_s": r.retry_after_s,
                "itls_s": [round(itl, 6) for itl in r.itls_s],
            }
            for r in results
        ],
    }
