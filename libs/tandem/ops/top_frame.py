"""What `tandem top` shows, as pure functions of two snapshots of the stack (now and the one
before, for rates): the chat and router figures and a row per worker. A figure whose metric a
process does not export (yet) shows as "-"."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


class Metrics:
    """One process's /metrics, flattened to (sample name, labels) -> value."""

    def __init__(self, samples: dict[tuple[str, Labels], float]) -> None:
        self._samples = samples

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
        return cls(samples)

    def _matching(self, name: str, labels: dict[str, str]) -> Iterable[tuple[Labels, float]]:
        wanted = set(labels.items())
        return ((lbls, v) for (n, lbls), v in self._samples.items() if n == name and wanted <= lbls)

    def total(self, name: str, **labels: str) -> float | None:
        """The sum over every sample of `name` with these labels; None when there is none."""
        values = [v for _, v in self._matching(name, labels)]
        return sum(values) if values else None

    def buckets(self, name: str, **labels: str) -> dict[float, float]:
        """A histogram's cumulative counts by upper bound, of the samples with these labels,
        summed over their other labels."""
        counts: dict[float, float] = {}
        for lbls, value in self._matching(f"{name}_bucket", labels):
            le = float(dict(lbls)["le"])
            counts[le] = counts.get(le, 0.0) + value
        return counts


def bucket_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile: the bucket where rank q * count falls, interpolated
    linearly inside it; the highest finite bound when it falls in +Inf. None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass(frozen=True)
class WorkerView:
    """One worker as the router lists it, with its /metrics (None when they could not be read)."""

    role: str
    instance_id: str
    is_ready: bool
    load: float | None
    metrics: Metrics | None


@dataclass(frozen=True)
class Snapshot:
    taken_s: float  # unix seconds
    chat: Metrics | None
    router: Metrics | None
    workers: list[WorkerView]
    problems: list[str] = field(default_factory=list)  # what could not be read, one line each


def _rate(name: str, now: Metrics | None, before: Metrics | None, elapsed_s: float, **labels: str) -> float | None:
    if now is None or before is None or elapsed_s <= 0:
        return None
    current, earlier = now.total(name, **labels), before.total(name, **labels)
    if current is None or earlier is None:
        return None
    return max(0.0, current - earlier) / elapsed_s


def windowed_quantile(q: float, name: str, now: Metrics | None, before: Metrics | None) -> float | None:
    """The quantile over the observations made since `before` when there are some, else over all."""
    if now is None:
        return None
    buckets = now.buckets(name)
    if before is not None:
        earlier = before.buckets(name)
        window = {le: count - earlier.get(le, 0.0) for le, count in buckets.items()}
        if window and max(window.values()) > 0:
            return bucket_quantile(q, window)
    return bucket_quantile(q, buckets)


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{1000 * value_s:.0f} ms"


def _ratio(part: float | None, whole: float | None) -> str:
    return "-" if part is None or not whole else f"{100 * part / whole:.0f}%"


WORKER_COLUMNS = (
    f"{'ROLE':<8} {'INSTANCE':<24} {'READY':<5} {'KV USE':>7} {'RUN':>4} {'WAIT':>5} {'GEN TOK/S':>10} {'PREFIX HIT':>10} {'STEP P95':>9}"
)


def _worker_row(worker: WorkerView, before: WorkerView | None, elapsed_s: float) -> str:
    m, b = worker.metrics, before.metrics if before else None
    kv = m.total("tandem_worker_kv_cache_usage_ratio") if m else None
    running = m.total("tandem_worker_requests_running") if m else None
    waiting = m.total("tandem_worker_requests_waiting") if m else None
    hits = m.total("tandem_worker_prefix_cache_hits_tokens_total") if m else None
    queries = m.total("tandem_worker_prefix_cache_queries_tokens_total") if m else None
    step_p95 = windowed_quantile(0.95, "tandem_worker_step_seconds", m, b)
    return (
        f"{worker.role:<8} {worker.instance_id[:24]:<24} {'yes' if worker.is_ready else 'no':<5} "
        f"{_num(None if kv is None else 100 * kv, '{:.1f}%'):>7} {_num(running, '{:.0f}'):>4} {_num(waiting, '{:.0f}'):>5} "
        f"{_num(_rate('tandem_worker_generation_tokens_total', m, b, elapsed_s)):>10} {_ratio(hits, queries):>10} "
        f"{_ms(step_p95):>9}"
    )


def render_frame(now: Snapshot, before: Snapshot | None = None, interval_s: float | None = None) -> str:
    """The frame as text: header, chat and router lines, the workers table, the queues, problems."""
    elapsed_s = now.taken_s - before.taken_s if before else 0.0
    chat, chat_before = now.chat, before.chat if before else None
    router, router_before = now.router, before.router if before else None
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now.taken_s))
    lines = [f"tandem top  {stamp}" + (f"  (every {interval_s:g} s)" if interval_s else "")]
    lines.append(
        f"chat    streams open {_num(chat.total('tandem_chat_streams_open') if chat else None, '{:.0f}')}"
        f"  replies/s {_num(_rate('tandem_chat_replies_total', chat, chat_before, elapsed_s), '{:.2f}')}"
        f"  output tok/s {_num(_rate('tandem_chat_output_tokens_total', chat, chat_before, elapsed_s))}"
        f"  TTFT p95 {_ms(windowed_quantile(0.95, 'tandem_chat_time_to_first_token_seconds', chat, chat_before))}"
        f"  ITL p95 {_ms(windowed_quantile(0.95, 'tandem_chat_inter_token_latency_seconds', chat, chat_before))}"
        f"  refused {_num(chat.total('tandem_chat_replies_refused_total') if chat else None, '{:.0f}')}"
    )
    lines.append(
        f"router  ladder rung {_num(router.total('tandem_router_ladder_rung') if router else None, '{:.0f}')}"
        f"  placements/s {_num(_rate('tandem_router_placements_total', router, router_before, elapsed_s), '{:.2f}')}"
        f"  queue wait p95 {_ms(windowed_quantile(0.95, 'tandem_router_queue_wait_seconds', router, router_before))}"
    )
    lines += ["", WORKER_COLUMNS]
    earlier = {w.instance_id: w for w in before.workers} if before else {}
    workers = sorted(now.workers, key=lambda w: (w.role, w.instance_id))
    lines += [_worker_row(w, earlier.get(w.instance_id), elapsed_s) for w in workers] or ["(no workers listed)"]
    waiting_by_role: dict[str, float] = {}
    for w in workers:
        waiting = w.metrics.total("tandem_worker_requests_waiting") if w.metrics else None
        if waiting is not None:
            waiting_by_role[w.role] = waiting_by_role.get(w.role, 0.0) + waiting
    queues = ", ".join(f"{role} {num:.0f}" for role, num in sorted(waiting_by_role.items())) or "-"
    lines += ["", f"queues  waiting: {queues}"]
    lines += [f"!       {problem}" for problem in now.problems]
    return "\n".join(lines)
