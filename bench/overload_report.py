"""The overload's report: each tier's outcomes summed up, and the tables the bench prints."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from overload_client import Outcome

TIERS = ("paid", "free")


@dataclass(frozen=True)
class Phase:
    """One phase of the run: its messages' outcomes and what the stack measured meanwhile."""

    outcomes: list[Outcome]
    stages: dict[str, dict[str, float | None]]  # where the admitted replies spent time (overload_metrics.stage_breakdown)
    cpu_s: dict[str, float]  # CPU seconds by process role, and the phase's wall time
    engine: dict[str, float]  # what the engines counted (overload_metrics.engine_counts)


@dataclass
class TierReport:
    tier: str
    sent: int = 0
    admitted: int = 0
    refused_429: int = 0
    refused_503: int = 0
    refused_other: int = 0
    refused_without_retry_after: int = 0
    completed: int = 0
    capped: int = 0  # completed with finish "length" below the requested max_tokens
    failed: int = 0
    timed_out: int = 0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    create_p50_s: float | None = None  # of the admitted: creating the conversation, the first part of their TTFT
    create_p95_s: float | None = None
    samples: list[str] = field(default_factory=list)


def summarize(outcomes: list[Outcome], max_tokens: int) -> dict[str, TierReport]:
    reports = {tier: TierReport(tier) for tier in TIERS}
    for o in outcomes:
        r = reports[o.tier]
        r.sent += 1
        if o.result == "refused":
            if o.status == 429:
                r.refused_429 += 1
            elif o.status == 503:
                r.refused_503 += 1
            else:
                r.refused_other += 1
                r.samples.append(o.detail)
            if not o.retry_after and o.status in (429, 503):
                r.refused_without_retry_after += 1
            continue
        if o.status == 200:
            r.admitted += 1
        if o.result == "complete":
            r.completed += 1
            usage = json.loads(o.detail or "{}")
            if o.finish == "length" and usage.get("output", max_tokens) < max_tokens:
                r.capped += 1
        elif o.result == "failed":
            r.failed += 1
            r.samples.append(o.detail)
        elif o.result == "timed_out":
            r.timed_out += 1
        else:
            r.failed += 1
            r.samples.append(o.detail)
    for tier, r in reports.items():
        ttfts = sorted(o.ttft_s for o in outcomes if o.tier == tier and o.ttft_s is not None)
        if ttfts:
            r.ttft_p50_s = round(percentile(ttfts, 50), 3)
            r.ttft_p95_s = round(percentile(ttfts, 95), 3)
        creates = sorted(o.create_s for o in outcomes if o.tier == tier and o.ttft_s is not None and o.create_s is not None)
        if creates:
            r.create_p50_s = round(percentile(creates, 50), 3)
            r.create_p95_s = round(percentile(creates, 95), 3)
        r.samples = r.samples[:3]
    return reports


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


def _stage_cells(figures: dict[str, float | None], count_width: int) -> str:
    mean = "-" if figures["mean_s"] is None else f"{figures['mean_s']:.3f}"
    p95 = "-" if figures["p95_s"] is None else f"{figures['p95_s']:.3f}"
    return f"{figures['count'] or 0:>{count_width}.0f}{mean:>9}{p95:>9}"


def print_tables(reports: dict[str, TierReport], overload: Phase, paid_alone: Phase, unloaded: Phase) -> None:
    """Each tier's outcomes in the overload; where the admitted replies spent time, and what the
    engine counted, in each phase; the CPU each process spent in the overload and paid alone."""
    print(
        f"\n{'tier':<6}{'sent':>6}{'admit':>7}{'429':>6}{'503':>6}{'other':>7}{'noRA':>6}{'done':>6}{'capped':>8}{'failed':>8}{'t/out':>7}{'TTFT p50':>10}{'p95':>8}{'of it, create p50':>19}{'p95':>8}"
    )
    for r in reports.values():
        p50 = "-" if r.ttft_p50_s is None else f"{r.ttft_p50_s:.2f}"
        p95 = "-" if r.ttft_p95_s is None else f"{r.ttft_p95_s:.2f}"
        create_p50 = "-" if r.create_p50_s is None else f"{r.create_p50_s:.3f}"
        create_p95 = "-" if r.create_p95_s is None else f"{r.create_p95_s:.3f}"
        print(
            f"{r.tier:<6}{r.sent:>6}{r.admitted:>7}{r.refused_429:>6}{r.refused_503:>6}{r.refused_other:>7}{r.refused_without_retry_after:>6}"
            f"{r.completed:>6}{r.capped:>8}{r.failed:>8}{r.timed_out:>7}{p50:>10}{p95:>8}{create_p50:>19}{create_p95:>8}"
        )
        for sample in r.samples:
            print(f"{'':<6}sample: {sample}")
    print(
        f"\n{'where the admitted replies spent time':<40}{'overload: count':>16}{'mean':>9}{'p95':>9}{'paid alone: count':>19}{'mean':>9}{'p95':>9}{'unloaded: count':>17}{'mean':>9}{'p95':>9}"
    )
    for row, figures in overload.stages.items():
        print(f"{row:<40}{_stage_cells(figures, 16)}{_stage_cells(paid_alone.stages[row], 19)}{_stage_cells(unloaded.stages[row], 17)}")
    for name, counts in (("overload", overload.engine), ("paid alone", paid_alone.engine), ("unloaded", unloaded.engine)):
        hit_share = counts["prefix_hit_tokens"] / counts["prefix_query_tokens"] if counts["prefix_query_tokens"] else 0.0
        print(
            f"engine, {name}: {counts['prefix_hit_tokens']:.0f} of {counts['prefix_query_tokens']:.0f} prompt tokens looked up "
            f"found in the prefix cache ({hit_share:.0%}), {counts['prompt_tokens_computed']:.0f} computed, {counts['output_tokens']:.0f} output, "
            f"{counts['steps_cut']:.0f} steps cut for a paid arrival"
        )
    print(f"\n{'CPU s by process (arrivals, drain)':<40}{'overload':>16}{'paid alone':>19}")
    for role, spent in overload.cpu_s.items():
        print(f"{role:<40}{spent:>16.1f}{paid_alone.cpu_s.get(role, 0.0):>19.1f}")
