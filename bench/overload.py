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
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import nats
import uvloop
from chat_client import Pool
from drill_client import TOPICS
from drill_stack import DrillStack
from overload_client import Outcome, Sender, send_message
from overload_metrics import LadderWatch, engine_counts, scrape, stage_breakdown
from overload_report import TIERS, Phase, percentile, print_tables, summarize
from procs import CpuMeter, descendants, pin, processes_by_role

from tandem.bus import subjects
from tandem.bus.connection import server_urls
from tandem.config import ApiKey, Tier, parse_cpu_list
from tandem.tls import nats_tls_options

WARM_UP_AT_ONCE = 8  # paid users sending their first, unmeasured message together


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
        nc = await nats.connect(server_urls(stack.stack.nats_url), **nats_tls_options(stack.stack.operator_tls))
        ladder = LadderWatch()
        await nc.subscribe(subjects.LADDER, cb=ladder.on_status)
        try:
            turn = dict.fromkeys(TIERS, 0)

            def next_sender(tier: str) -> Sender:
                turn[tier] += 1
                number = turn[tier] % len(users[tier])
                return Sender(f"key-{users[tier][number]}", TOPICS[number % len(TOPICS)])

            async def phase(run: Awaitable[list[Outcome]]) -> Phase:
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
                return Phase(outcomes, stage_breakdown(before, after), cpu, engine_counts(before, after))

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

            unloaded = await phase(one_at_a_time())
            unloaded_ttfts = sorted(o.ttft_s for o in unloaded.outcomes if o.ttft_s is not None)
            if not unloaded_ttfts:
                print(f"no unloaded reply completed: {[o.detail for o in unloaded.outcomes]}", file=sys.stderr)
                return 1
            unloaded_p95 = percentile(unloaded_ttfts, 95)
            print(f"unloaded paid TTFT p50 {percentile(unloaded_ttfts, 50):.3f} s, p95 {unloaded_p95:.3f} s", flush=True)

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
            paid_alone = await phase(open_loop(args.paid_alone_s, rate * args.paid_share, 5_000, lambda: "paid"))
            alone = summarize(paid_alone.outcomes, args.max_tokens)["paid"]
            print(f"paid alone at {rate * args.paid_share:.2f}/s: TTFT p50 {alone.ttft_p50_s} s, p95 {alone.ttft_p95_s} s", flush=True)

            # 4. overload: open loop
            overload = await phase(open_loop(args.seconds, rate, 10_000, lambda: "paid" if rng.random() < args.paid_share else "free"))
        finally:
            pool.close()
            await nc.close()
    reports = summarize(overload.outcomes, args.max_tokens)
    paid = reports["paid"]
    hung = sum(r.timed_out for r in reports.values())
    refusals_without = sum(r.refused_without_retry_after for r in reports.values())
    paid_ok = paid.ttft_p95_s is not None and paid.ttft_p95_s <= 2 * unloaded_p95
    print_tables(reports, overload, paid_alone, unloaded)
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
            "stages": overload.stages,
            "paid_alone_stages": paid_alone.stages,
            "unloaded_stages": unloaded.stages,
            "cpu_s": {"overload": overload.cpu_s, "paid_alone": paid_alone.cpu_s},
            "engine": {"overload": overload.engine, "paid_alone": paid_alone.engine},
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
