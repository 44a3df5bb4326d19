"""Overload: a real local stack (`tandem up`'s launcher: nats-server, redis-server, router, relay,
one decode worker, one chat instance) is driven past what it can serve, and each tier's experience
is reported.

1. unloaded: paid messages one at a time give the paid TTFT the loaded run is held to;
2. capacity: `--probe-clients` clients send back to back for `--probe-s`, giving the replies per
   second the stack completes;
3. paid alone: paid messages arrive open-loop at the rate they arrive at in the overload, with
   no free traffic, for `--paid-alone-s`: what paid's own load costs its TTFT on this machine;
4. overload: messages arrive open-loop (Poisson) at `--factor` times that rate for `--seconds`, a
   `--paid-share` of them from paid users and the rest from free users, each user in turn.

Per tier it reports: sent, admitted, refused (429 / 503, and whether each refusal carried a
Retry-After), completed, failed, timed out (no final event within `--hang-s` of sending), TTFT
p50/p95 of the admitted, and the overload ladder's rungs (LadderStatus on the bus). Targets are
printed beside the numbers (PASS/MISS), never as an exit code:
0 timeouts and 0 hung replies; paid TTFT p95 at most 2x its unloaded value; every refusal carries
Retry-After.

    .venv/bin/python bench/overload.py --out overload.json
    .venv/bin/python bench/overload.py --quick            # smoke sizes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import nats
import uvloop
from chat_client import Event, Pool, ProtocolError, read_events
from drill_stack import DrillStack
from drills import TOPICS
from procs import CpuMeter, descendants, pin, processes_by_role

from tandem.bus import BadMessage, decode, subjects
from tandem.config import ApiKey, Tier, parse_cpu_list
from tandem.ops.top_frame import Metrics, bucket_quantile
from tandem.v1.worker_pb2 import LadderStatus

TIERS = ("paid", "free")
WARM_UP_AT_ONCE = 8  # paid users sending their first, unmeasured message together


@dataclass
class Outcome:
    tier: str
    sent_s: float
    status: int = 0  # HTTP status of the message POST (0: no answer)
    retry_after: str | None = None
    result: str = "timed_out"  # complete | failed | refused | timed_out | http_error
    finish: str = ""
    ttft_s: float | None = None
    create_s: float | None = None  # the conversation's creation, part of ttft_s
    detail: str = ""


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


@dataclass(frozen=True)
class Sender:
    """A user's key and their subject: each user asks about a topic of their own, so a user's
    prompts share their first KV blocks (a tenant's own prefix cache), as a conversation's turns
    share its history, and do so alike in every phase. (A topic drawn from the message's index
    gave users 16 and 32 apart a fixed topic while only paid messages were sent, and a random one
    in the mixed overload: 47 % and 17 % of paid prompt tokens from the cache, so the bar and the
    overload measured different prompts.)"""

    key: str
    topic: str


def prompt(sender: Sender, index: int) -> str:
    return f"Explain {sender.topic} in a few short paragraphs. (message {index})"


async def send_message(pool: Pool, sender: Sender, tier: str, index: int, max_tokens: int, hang_s: float) -> Outcome:
    """One message in a new conversation, read to its final event (or to `hang_s` after sending)."""
    headers = {"Authorization": f"Bearer {sender.key}"}
    outcome = Outcome(tier=tier, sent_s=time.monotonic())
    try:
        async with asyncio.timeout(hang_s):
            connection, created = await pool.request("POST", "/v1/conversations", headers, {})
            body = await connection.body(created)
            pool.give(connection)
            if created.status != 201:
                return _refused(outcome, created.status, created.headers.get("retry-after"), body.decode(errors="replace"))
            outcome.create_s = time.monotonic() - outcome.sent_s
            conversation_id = json.loads(body)["id"]
            payload = {"content": prompt(sender, index), "temperature": 0, "max_tokens": max_tokens}
            connection, answer = await pool.request("POST", f"/v1/conversations/{conversation_id}/messages", headers, payload)
            outcome.status = answer.status
            if answer.status != 200:
                body = await connection.body(answer)
                pool.give(connection)
                return _refused(outcome, answer.status, answer.headers.get("retry-after"), body.decode(errors="replace"))

            def on_event(event: Event) -> None:
                if event.name == "delta" and outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - outcome.sent_s
                elif event.name == "done" and outcome.result == "timed_out":
                    data = json.loads(event.data)
                    outcome.result, outcome.finish = "complete", str(data.get("finish", ""))
                    outcome.detail = json.dumps(data.get("usage", {}))
                elif event.name == "error" and outcome.result == "timed_out":
                    outcome.result, outcome.detail = "failed", event.data.decode(errors="replace")[:200]

            await read_events(connection, answer, on_event)
            pool.give(connection)
            if outcome.result == "timed_out":
                outcome.result, outcome.detail = "http_error", "the stream ended without a final event"
    except TimeoutError:
        outcome.result = "timed_out"
    except (OSError, asyncio.IncompleteReadError, ProtocolError, ValueError) as exc:
        outcome.result = "http_error"
        outcome.detail = f"{type(exc).__name__}: {exc}"[:200]
    return outcome


def _refused(outcome: Outcome, status: int, retry_after: str | None, text: str) -> Outcome:
    outcome.status = status
    outcome.retry_after = retry_after
    outcome.result = "refused"
    outcome.detail = f"{status}: {text[:160]}"
    return outcome


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
            r.ttft_p50_s = round(_percentile(ttfts, 50), 3)
            r.ttft_p95_s = round(_percentile(ttfts, 95), 3)
        creates = sorted(o.create_s for o in outcomes if o.tier == tier and o.ttft_s is not None and o.create_s is not None)
        if creates:
            r.create_p50_s = round(_percentile(creates, 50), 3)
            r.create_p95_s = round(_percentile(creates, 95), 3)
        r.samples = r.samples[:3]
    return reports


def pin_engine_apart(stack: DrillStack, engine_cpus: frozenset[int]) -> None:
    """The decode worker's engine process on `engine_cpus`, alone; everything else (the worker's
    own process, the other services, redis, nats, this process) on the rest: the engine's cores
    to itself, as on a machine of its own, or as vLLM's CPU backend binds its threads apart from
    its frontend's."""
    rest = frozenset(os.sched_getaffinity(0)) - engine_cpus
    if not engine_cpus or not rest:
        raise SystemExit(f"--engine-cpus must leave other CPUs for the rest; this process may use {sorted(os.sched_getaffinity(0))}")
    for member in stack.stack.members:
        if member.pid is not None:
            pin(member.pid, rest, with_children=False)
            for child in descendants(member.pid):
                pin(child, engine_cpus if member.role == "decode" else rest, with_children=False)
    pin(os.getpid(), rest, with_children=False)


def _stage_cells(figures: dict[str, float | None], count_width: int) -> str:
    mean = "-" if figures["mean_s"] is None else f"{figures['mean_s']:.3f}"
    p95 = "-" if figures["p95_s"] is None else f"{figures['p95_s']:.3f}"
    return f"{figures['count'] or 0:>{count_width}.0f}{mean:>9}{p95:>9}"


def _percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


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
            response = await http.get(f"{member.url}/metrics")
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


async def main(args: argparse.Namespace) -> int:
    users = {tier: [f"{tier}-user-{i}" for i in range(args.users)] for tier in TIERS}
    keys = {f"key-{user}": ApiKey(user_id=user, tier=Tier.PLUS if tier == "paid" else Tier.FREE) for tier in TIERS for user in users[tier]}
    env = {"TANDEM_KV_CACHE_MIB": "128", "TANDEM_LOG_LEVEL": "warning", "TANDEM_LADDER_INTERVAL_S": str(args.ladder_interval_s)}
    env.update(dict(item.split("=", 1) for item in args.env))
    stack = DrillStack(decode_workers=1, prefill_workers=0, chat_instances=1, extra_env=env, api_keys=keys)
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with stack, httpx.AsyncClient(timeout=httpx.Timeout(args.hang_s, connect=30.0), limits=limits) as http:
        await stack.wait_all_ready(timeout_s=300.0)
        if args.engine_cpus:
            pin_engine_apart(stack, parse_cpu_list(args.engine_cpus))
        chat = urlsplit(stack.chat_urls[0])
        pool = Pool(chat.hostname or "127.0.0.1", chat.port or 80)
        nc = await nats.connect(stack.stack.nats_url)
        ladder = LadderWatch()
        await nc.subscribe(subjects.LADDER, cb=ladder.on_status)
        try:
            turn = dict.fromkeys(TIERS, 0)

            def next_sender(tier: str) -> Sender:
                turn[tier] += 1
                number = turn[tier] % len(users[tier])
                return Sender(f"key-{users[tier][number]}", TOPICS[number % len(TOPICS)])

            async def phase(
                run: Awaitable[list[Outcome]],
            ) -> tuple[list[Outcome], dict[str, dict[str, float | None]], dict[str, float], dict[str, float]]:
                """A phase's outcomes, where its replies spent time, the CPU seconds each role
                spent and what the engine counted."""
                meter = CpuMeter({**processes_by_role(stack.stack), "bench (the clients)": [os.getpid()]})
                before = await scrape(http, stack)
                meter.start()
                started_s = time.monotonic()
                outcomes = await run
                cpu = meter.stop()
                cpu["(the phase's wall time)"] = round(time.monotonic() - started_s, 1)
                after = await scrape(http, stack)
                return outcomes, stage_breakdown(before, after), cpu, engine_counts(before, after)

            # 0. every paid user's first message, unmeasured: the bar is measured as warm as the
            # loaded phases' prompts are
            for first in range(0, args.users, WARM_UP_AT_ONCE):
                await asyncio.gather(
                    *(
                        send_message(pool, next_sender("paid"), "paid", i, args.max_tokens, args.hang_s)
                        for i in range(first, min(first + WARM_UP_AT_ONCE, args.users))
                    )
                )

            # 1. unloaded paid TTFT
            async def one_at_a_time() -> list[Outcome]:
                return [
                    await send_message(pool, next_sender("paid"), "paid", 100 + i, args.max_tokens, args.hang_s)
                    for i in range(args.baseline)
                ]

            unloaded, unloaded_stages, _, unloaded_engine = await phase(one_at_a_time())
            unloaded_ttfts = sorted(o.ttft_s for o in unloaded if o.ttft_s is not None)
            if not unloaded_ttfts:
                print(f"no unloaded reply completed: {[o.detail for o in unloaded]}", file=sys.stderr)
                return 1
            unloaded_p95 = _percentile(unloaded_ttfts, 95)
            print(f"unloaded paid TTFT p50 {_percentile(unloaded_ttfts, 50):.3f} s, p95 {unloaded_p95:.3f} s", flush=True)

            # 2. capacity: closed loop
            completed = 0
            probe_end = time.monotonic() + args.probe_s

            async def probe_client(c: int) -> None:
                nonlocal completed
                i = 0
                while time.monotonic() < probe_end:
                    o = await send_message(pool, next_sender("paid"), "paid", 1000 + 100 * c + i, args.max_tokens, args.hang_s)
                    completed += o.result == "complete"
                    i += 1

            probe_start = time.monotonic()
            await asyncio.gather(*(probe_client(c) for c in range(args.probe_clients)))
            capacity_rps = completed / (time.monotonic() - probe_start)
            rate = args.factor * max(capacity_rps, 0.05)
            print(
                f"capacity {capacity_rps:.2f} replies/s with {args.probe_clients} clients; offering {rate:.2f}/s for {args.seconds:.0f} s",
                flush=True,
            )

            async def open_loop(seconds: float, rate: float, first_index: int, pick_tier: Callable[[], str]) -> list[Outcome]:
                tasks: list[asyncio.Task[Outcome]] = []
                load_end = time.monotonic() + seconds
                index = first_index
                while time.monotonic() < load_end:
                    tier = pick_tier()
                    tasks.append(asyncio.create_task(send_message(pool, next_sender(tier), tier, index, args.max_tokens, args.hang_s)))
                    index += 1
                    await asyncio.sleep(rng.expovariate(rate))
                return list(await asyncio.gather(*tasks))

            # 3. paid alone, at the rate it arrives at in the overload: what paid's own load costs it
            alone_outcomes, alone_stages, alone_cpu, alone_engine = await phase(
                open_loop(args.paid_alone_s, rate * args.paid_share, 5_000, lambda: "paid")
            )
            alone = summarize(alone_outcomes, args.max_tokens)["paid"]
            print(f"paid alone at {rate * args.paid_share:.2f}/s: TTFT p50 {alone.ttft_p50_s} s, p95 {alone.ttft_p95_s} s", flush=True)

            # 4. overload: open loop
            outcomes, stages, cpu, engine = await phase(
                open_loop(args.seconds, rate, 10_000, lambda: "paid" if rng.random() < args.paid_share else "free")
            )
        finally:
            pool.close()
            await nc.close()
    reports = summarize(outcomes, args.max_tokens)
    paid = reports["paid"]
    hung = sum(r.timed_out for r in reports.values())
    refusals_without = sum(r.refused_without_retry_after for r in reports.values())
    paid_ok = paid.ttft_p95_s is not None and paid.ttft_p95_s <= 2 * unloaded_p95
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
    for row, figures in stages.items():
        print(f"{row:<40}{_stage_cells(figures, 16)}{_stage_cells(alone_stages[row], 19)}{_stage_cells(unloaded_stages[row], 17)}")
    for name, counts in (("overload", engine), ("paid alone", alone_engine), ("unloaded", unloaded_engine)):
        hit_share = counts["prefix_hit_tokens"] / counts["prefix_query_tokens"] if counts["prefix_query_tokens"] else 0.0
        print(
            f"engine, {name}: {counts['prefix_hit_tokens']:.0f} of {counts['prefix_query_tokens']:.0f} prompt tokens looked up "
            f"found in the prefix cache ({hit_share:.0%}), {counts['prompt_tokens_computed']:.0f} computed, {counts['output_tokens']:.0f} output, "
            f"{counts['steps_cut']:.0f} steps cut for a paid arrival"
        )
    print(f"\n{'CPU s by process (arrivals, drain)':<40}{'overload':>16}{'paid alone':>19}")
    for role, spent in cpu.items():
        print(f"{role:<40}{spent:>16.1f}{alone_cpu.get(role, 0.0):>19.1f}")
    print(f"\nladder: max rung {ladder.max_rung}; (s, rung, busyness): {ladder.statuses[-12:]}")
    print(f"{'PASS' if hung == 0 else 'MISS'} 0 timed out / hung: {hung}")
    print(f"{'PASS' if paid_ok else 'MISS'} paid TTFT p95 {paid.ttft_p95_s} s <= 2 x unloaded {unloaded_p95:.3f} s")
    print(f"(paid alone at its overload rate, no free traffic: TTFT p95 {alone.ttft_p95_s} s)")
    print(f"{'PASS' if refusals_without == 0 else 'MISS'} every refusal carries Retry-After ({refusals_without} without)")
    if args.out:
        data = {
            "unloaded_paid_ttft_p95_s": round(unloaded_p95, 3),
            "paid_alone": asdict(alone),
            "capacity_replies_per_s": round(capacity_rps, 3),
            "offered_per_s": round(rate, 3),
            "seconds": args.seconds,
            "tiers": {tier: asdict(r) for tier, r in reports.items()},
            "stages": stages,
            "paid_alone_stages": alone_stages,
            "unloaded_stages": unloaded_stages,
            "cpu_s": {"overload": cpu, "paid_alone": alone_cpu},
            "engine": {"overload": engine, "paid_alone": alone_engine},
            "ladder": {"max_rung": ladder.max_rung, "statuses": ladder.statuses},
            "targets": {
                "no_timeouts": hung == 0,
                "paid_ttft_p95_within_2x": paid_ok,
                "every_refusal_has_retry_after": refusals_without == 0,
            },
        }
        Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90.0, help="how long the overload lasts")
    parser.add_argument("--factor", type=float, default=5.0, help="offered load as a multiple of the measured capacity")
    parser.add_argument(
        "--paid-share", type=float, default=0.1, help="share of messages from paid users (0.1 at 5x: paid alone is half the capacity)"
    )
    parser.add_argument("--users", type=int, default=32, help="users per tier, each sending in turn")
    parser.add_argument("--max-tokens", type=int, default=48, help="each answer's max_tokens")
    parser.add_argument(
        "--baseline",
        type=int,
        default=60,
        help="unloaded paid messages, one at a time (their p95 is the bar; over 20 it moved 0.045-0.077 s)",
    )
    parser.add_argument("--probe-clients", type=int, default=32, help="closed-loop clients measuring capacity")
    parser.add_argument("--probe-s", type=float, default=30.0, help="how long capacity is measured")
    parser.add_argument("--hang-s", type=float, default=120.0, help="a message with no final event by then timed out")
    parser.add_argument("--ladder-interval-s", type=float, default=5.0, help="TANDEM_LADDER_INTERVAL_S for the stack")
    parser.add_argument("--paid-alone-s", type=float, default=30.0, help="how long paid traffic alone runs at its overload rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-cpus",
        default="",
        help="the decode worker's engine process alone on these CPUs (`1`, `2-3`), everything else on the others",
    )
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every service (repeatable)")
    parser.add_argument("--out", default="", help="write the report as JSON here")
    parser.add_argument("--quick", action="store_true", help="smoke sizes: 8 s of overload at 3x, 4 s of probing with 4 clients")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.factor, args.baseline, args.probe_clients, args.probe_s, args.max_tokens = 8.0, 3.0, 2, 4, 4.0, 16
        args.paid_alone_s = 4.0
    return args


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # uvloop: the bench's own clients share the machine's cores with the stack they measure.
    sys.exit(uvloop.run(main(parse_args())))
