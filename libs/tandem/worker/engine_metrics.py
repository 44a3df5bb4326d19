"""The engine's numbers as this worker's Prometheus metrics. The engine knows nothing of
Prometheus: it keeps plain counts (EngineStats) and the queue waits of the requests it admitted.
After every change the engine thread calls `EngineMetrics.observe` with the fresh stats: gauges
are set, counters grow by what changed since the previous stats, a new step's time goes into the
step histogram under its kind (prefill, decode or mixed, from which token counts grew). That is a
few dozen lock-protected additions per step, nothing per token.

The cost per million output tokens is read at scrape time: the worker-hour cost over the output
tokens per hour of the last `window_s` (OutputRate)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client import Counter

from tandem.engine.engine import EngineStats, QueueWait
from tandem.engine.sequence import Lane
from tandem.worker import metrics

COST_WINDOW_S = 300.0


class OutputRate:
    """Output tokens per second over a recent window, from the running total. Samples are kept at
    most one per `resolution_s`; thread-safe (the engine thread adds, a scrape reads)."""

    def __init__(self, window_s: float = COST_WINDOW_S, resolution_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._resolution_s = resolution_s
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque([(clock(), 0)])  # (time, total), oldest first
        self._total = 0

    def add(self, num_total_tokens: int) -> None:
        """The running total of output tokens now."""
        now = self._clock()
        with self._lock:
            self._total = num_total_tokens
            if now - self._samples[-1][0] >= self._resolution_s:
                self._samples.append((now, num_total_tokens))
            # Keep one sample at or before the window's start as the baseline.
            while len(self._samples) > 1 and self._samples[1][0] <= now - self._window_s:
                self._samples.popleft()

    def tokens_per_s(self) -> float:
        now = self._clock()
        with self._lock:
            baseline_s, baseline_total = self._samples[0]
            for sample_s, total in self._samples:  # the newest sample at or before the window's start
                if sample_s > now - self._window_s:
                    break
                baseline_s, baseline_total = sample_s, total
            num_tokens = self._total - baseline_total
        # Tokens since a baseline older than the window came within it (no step ran between:
        # the engine adds a sample at least every resolution_s while it works).
        span_s = min(now - baseline_s, self._window_s)
        return num_tokens / span_s if num_tokens > 0 and span_s > 0 else 0.0


def cost_per_million_tokens(cost_per_hour: float, tokens_per_s: float) -> float:
    """What a million output tokens cost at this rate; 0 when idle or the cost is unknown."""
    if cost_per_hour <= 0 or tokens_per_s <= 0:
        return 0.0
    return cost_per_hour / (tokens_per_s * 3600) * 1e6


def step_kind(num_prefill_tokens: int, num_decode_tokens: int) -> str | None:
    if num_prefill_tokens and num_decode_tokens:
        return "mixed"
    if num_prefill_tokens:
        return "prefill"
    return "decode" if num_decode_tokens else None


class EngineMetrics:
    """One worker's engine metrics, labelled with its role and model."""

    def __init__(self, role: str, model: str, worker_hour_cost: float = 0.0, output_rate: OutputRate | None = None) -> None:
        labels = {"role": role, "model": model}
        self._running = {lane: metrics.REQUESTS_RUNNING.labels(**labels, lane=_name(lane)) for lane in Lane}
        self._waiting = {lane: metrics.REQUESTS_WAITING.labels(**labels, lane=_name(lane)) for lane in Lane}
        self._waits = {
            "admitted": {lane: metrics.QUEUE_WAIT.labels(**labels, lane=_name(lane)) for lane in Lane},
            "first_token": {lane: metrics.TIME_TO_FIRST_TOKEN.labels(**labels, lane=_name(lane)) for lane in Lane},
        }
        self._steps = {kind: metrics.STEP_SECONDS.labels(**labels, kind=kind) for kind in ("prefill", "decode", "mixed")}
        self._kv_usage = metrics.KV_CACHE_USAGE.labels(**labels)
        self._kv_prefix_cached = metrics.KV_CACHE_PREFIX_CACHED.labels(**labels)
        self._queued_prefill_tokens = metrics.QUEUED_PREFILL_TOKENS.labels(**labels)
        self._prefix_queries = metrics.PREFIX_CACHE_QUERIES.labels(**labels)
        self._prefix_hits = metrics.PREFIX_CACHE_HITS.labels(**labels)
        self._prompt_tokens = metrics.PROMPT_TOKENS.labels(**labels)
        self._generation_tokens = metrics.GENERATION_TOKENS.labels(**labels)
        self._preemptions = metrics.PREEMPTIONS.labels(**labels)
        self._steps_cut = metrics.STEPS_CUT.labels(**labels)
        self._last: EngineStats | None = None
        self._rate = output_rate or OutputRate()
        metrics.COST_PER_HOUR.labels(**labels).set(worker_hour_cost)
        metrics.COST_PER_MTOK.labels(**labels).set_function(lambda: cost_per_million_tokens(worker_hour_cost, self._rate.tokens_per_s()))

    def observe(self, stats: EngineStats, queue_waits: Iterable[QueueWait] = ()) -> None:
        """Called on the engine thread after every change, with its fresh stats."""
        s = stats.scheduler
        last = self._last
        self._last = stats
        if last is None or s.num_running != last.scheduler.num_running or s.num_waiting != last.scheduler.num_waiting:
            for lane in Lane:
                self._running[lane].set(s.num_running[lane])
                self._waiting[lane].set(s.num_waiting[lane])
        self._kv_usage.set(stats.kv_cache_usage)
        self._kv_prefix_cached.set(stats.kv_cache_prefix_cached)
        self._queued_prefill_tokens.set(s.num_queued_prefill_tokens)
        for wait in queue_waits:
            self._waits[wait.until][wait.lane].observe(wait.wait_s)
        if last is None:
            self._prefix_queries.inc(s.num_prefix_query_tokens)
            self._prefix_hits.inc(s.num_prefix_hit_tokens)
            self._prompt_tokens.inc(stats.num_prefill_tokens)
            self._generation_tokens.inc(stats.num_generated_tokens)
            self._preemptions.inc(s.num_preemptions)
            self._steps_cut.inc(stats.num_cut_steps)
            self._rate.add(stats.num_generated_tokens)
            return
        last_scheduler = last.scheduler
        _grow(self._prefix_queries, s.num_prefix_query_tokens - last_scheduler.num_prefix_query_tokens)
        _grow(self._prefix_hits, s.num_prefix_hit_tokens - last_scheduler.num_prefix_hit_tokens)
        _grow(self._prompt_tokens, stats.num_prefill_tokens - last.num_prefill_tokens)
        _grow(self._generation_tokens, stats.num_generated_tokens - last.num_generated_tokens)
        _grow(self._preemptions, s.num_preemptions - last_scheduler.num_preemptions)
        _grow(self._steps_cut, stats.num_cut_steps - last.num_cut_steps)
        if stats.num_steps > last.num_steps:
            kind = step_kind(stats.num_prefill_tokens - last.num_prefill_tokens, stats.num_decode_tokens - last.num_decode_tokens)
            if kind is not None:
                step_s = stats.prefill_time_s + stats.decode_time_s - last.prefill_time_s - last.decode_time_s
                self._steps[kind].observe(step_s)
        self._rate.add(stats.num_generated_tokens)


class HandoffMetrics:
    """One worker's KV transfers, on the side it plays: "send" (prefill) or "receive" (decode)."""

    def __init__(self, role: str, model: str) -> None:
        self._labels = {"role": role, "model": model}
        for side in ("send", "receive"):  # listed at 0 before the first handoff
            metrics.KV_HANDOFF_BYTES.labels(**self._labels, side=side)
            metrics.KV_HANDOFF_SECONDS.labels(**self._labels, side=side)
            metrics.KV_HANDOFFS.labels(**self._labels, side=side, outcome="ok")

    def completed(self, side: str, num_bytes: int, seconds: float) -> None:
        metrics.KV_HANDOFFS.labels(**self._labels, side=side, outcome="ok").inc()
        metrics.KV_HANDOFF_BYTES.labels(**self._labels, side=side).inc(num_bytes)
        metrics.KV_HANDOFF_SECONDS.labels(**self._labels, side=side).observe(seconds)

    def failed(self, side: str, outcome: str) -> None:
        """`outcome`: why, as a short code (a KvTransferError's reason, a commit's refusal)."""
        metrics.KV_HANDOFFS.labels(**self._labels, side=side, outcome=outcome).inc()


def _grow(counter: Counter, amount: float) -> None:
    if amount > 0:
        counter.inc(amount)


def _name(lane: Lane) -> str:
    return lane.name.lower()
