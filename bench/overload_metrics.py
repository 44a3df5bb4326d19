"""What the stack's services measured during an overload phase: where an admitted reply's time
went (the services' histograms), what the engine counted, and the overload ladder's rungs."""

from __future__ import annotations

import time
from typing import Any

import httpx
from drill_stack import DrillStack

from tandem.bus import BadMessage, decode
from tandem.ops.top_frame import Metrics, bucket_quantile
from tandem.v1.worker_pb2 import LadderStatus

# Where an admitted reply's time goes, from the services' histograms over the overload phase:
# (row name, process role, histogram, labels).
STAGES = (
    ("chat TTFT, paid", "chat", "tandem_chat_time_to_first_token_seconds", {"tier": "plus"}),
    ("chat TTFT, free", "chat", "tandem_chat_time_to_first_token_seconds", {"tier": "free"}),
    ("router wait, paid", "router", "tandem_router_queue_wait_seconds", {"lane": "paid"}),
    ("router wait, free", "router", "tandem_router_queue_wait_seconds", {"lane": "free"}),
    ("engine queue, paid", "decode", "tandem_worker_queue_wait_seconds", {"lane": "paid"}),
    ("engine queue, free", "decode", "tandem_worker_queue_wait_seconds", {"lane": "free"}),
    ("engine TTFT, paid", "decode", "tandem_worker_time_to_first_token_seconds", {"lane": "paid"}),
    ("engine TTFT, free", "decode", "tandem_worker_time_to_first_token_seconds", {"lane": "free"}),
    ("step, decode only", "decode", "tandem_worker_step_seconds", {"kind": "decode"}),
    ("step, mixed", "decode", "tandem_worker_step_seconds", {"kind": "mixed"}),
    ("step, prefill only", "decode", "tandem_worker_step_seconds", {"kind": "prefill"}),
    ("token produced to chat's write", "chat", "tandem_chat_stream_write_delay_seconds", {}),
    ("event loop lag, chat", "chat", "tandem_event_loop_lag_seconds", {}),
    ("event loop lag, relay", "relay", "tandem_event_loop_lag_seconds", {}),
    ("event loop lag, router", "router", "tandem_event_loop_lag_seconds", {}),
    ("event loop lag, decode worker", "decode", "tandem_event_loop_lag_seconds", {}),
)


async def scrape(http: httpx.AsyncClient, stack: DrillStack) -> dict[str, list[Metrics]]:
    """Every chat, router, relay and decode process's /metrics, by role."""
    snapshot: dict[str, list[Metrics]] = {}
    for role in ("chat", "router", "relay", "decode"):
        for member in stack.stack.members_of(role):
            response = await http.get(f"{member.ops_url}/metrics")
            snapshot.setdefault(role, []).append(Metrics.parse(response.text))
    return snapshot


def stage_breakdown(before: dict[str, list[Metrics]], after: dict[str, list[Metrics]]) -> dict[str, dict[str, float | None]]:
    """Each stage's observations during the phase: count, mean and p95 (from the buckets)."""
    rows: dict[str, dict[str, float | None]] = {}
    for row, role, name, labels in STAGES:
        count, total = grown(before, after, role, f"{name}_count", **labels), grown(before, after, role, f"{name}_sum", **labels)
        buckets: dict[float, float] = {}
        for earlier, now in zip(before.get(role, []), after.get(role, []), strict=True):
            earlier_buckets = earlier.buckets(name, **labels)
            for bound, value in now.buckets(name, **labels).items():
                buckets[bound] = buckets.get(bound, 0.0) + value - earlier_buckets.get(bound, 0.0)
        p95 = bucket_quantile(0.95, buckets) if count else None
        rows[row] = {"count": count, "mean_s": round(total / count, 4) if count else None, "p95_s": None if p95 is None else round(p95, 4)}
    return rows


ENGINE_COUNTERS = {
    "prefix_query_tokens": "tandem_worker_prefix_cache_queries_tokens_total",
    "prefix_hit_tokens": "tandem_worker_prefix_cache_hits_tokens_total",
    "prompt_tokens_computed": "tandem_worker_prompt_tokens_total",
    "output_tokens": "tandem_worker_generation_tokens_total",
    "steps_cut": "tandem_worker_steps_cut_total",
}


def engine_counts(before: dict[str, list[Metrics]], after: dict[str, list[Metrics]]) -> dict[str, float]:
    """What the decode workers' engines counted during the phase: prompt tokens looked up in the
    prefix cache and found there, prompt tokens computed, output tokens."""
    return {key: grown(before, after, "decode", name) for key, name in ENGINE_COUNTERS.items()}


def grown(before: dict[str, list[Metrics]], after: dict[str, list[Metrics]], role: str, name: str, **labels: str) -> float:
    """How much a counter (or a histogram's _count or _sum) grew over the phase, summed over the role's processes."""
    return sum(
        (now.total(name, **labels) or 0.0) - (earlier.total(name, **labels) or 0.0)
        for earlier, now in zip(before.get(role, []), after.get(role, []), strict=True)
    )


class LadderWatch:
    """Every LadderStatus a router publishes during the run."""

    def __init__(self) -> None:
        self.statuses: list[tuple[float, int, float]] = []  # (seconds since start, rung, busyness)
        self._start_s = time.monotonic()

    async def on_status(self, msg: Any) -> None:
        try:
            status = decode(msg.data, LadderStatus)
        except BadMessage:
            return
        self.statuses.append((round(time.monotonic() - self._start_s, 1), status.rung, round(status.busyness, 3)))

    @property
    def max_rung(self) -> int:
        return max((rung for _, rung, _ in self.statuses), default=0)
