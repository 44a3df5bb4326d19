"""Failure drills: a real local stack (`tandem up`'s launcher: nats-server, redis-server, router,
relay, 2 decode workers, 1 prefill worker, 2 chat instances) is started here,
a load of streaming replies is driven through the chat API, and a fault is caused mid-stream.
Each drill reports how many replies completed, ended with an error, or hung (no final event
within `--hang-s`), the longest pause any client saw between two events once its answer began, whether greedy texts
match an undisturbed run of the same prompts, whether every client saw contiguous event ids,
and what the store holds afterwards.

    .venv/bin/python bench/drills.py --out drills.json                 # every drill
    .venv/bin/python bench/drills.py --drills kill_decode,kill_relay   # some of them

Drills (names for --drills):
  kill_decode    kill -9 one decode worker with N replies streaming
  kill_decode_rank  kill -9 one rank of a decode worker's tensor-parallel engine (--tensor-parallel-size N)
  kill_prefill   kill -9 the prefill worker with long prompts (remote prefill) in flight
  kill_relay     kill -9 the relay during N streams
  restart_redis  stop redis-server (SIGTERM) and start it again during N streams
  pause_nats     SIGSTOP nats-server for 10 s during N streams, then SIGCONT
  rolling        SIGTERM every service in turn (each restarted by the launcher) under a steady load
  resume         random client disconnects and resumes (Last-Event-ID), alternating chat instances
  kill_nats_node         kill -9 the NATS node the relay is connected to (--ha: a cluster of three)
  kill_nats_leader       kill -9 the NATS node leading the token stream (--ha): the worst node to lose
  kill_redis_primary     kill -9 the Redis primary (--ha: the sentinels promote a replica)
  partition_decode       cut the busiest decode worker's host off the network (link down) for 10 s, then heal it
  partition_relay_redis  cut the relay's host off Redis's host (and only that) for 10 s, then join them
  reconnect_storm        kill -9 a chat instance holding N streams (--storm-streams); all reconnect to the other at once

With --hosts (implied by the partition drills) every process runs on a host of its own: a network
namespace each, with its own address on a bridge (tandem.devstack.hosts; root only). A partition
drill also reports the longest a reply still streaming at the heal waited for its next event.

Targets are printed beside the numbers as information (PASS/MISS), never as an exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable
from dataclasses import asdict
from pathlib import Path

import httpx
import uvloop
from drill_client import HANG_S, Client, StreamResult, prompt_of
from drill_faults import HA_DRILLS, HOST_DRILLS, Fault, met, plans
from drill_report import DrillReport, print_row, print_table
from drill_stack import DrillStack
from drill_storm import STORM_KEYS


async def run_load(
    stack: DrillStack,
    client: Client,
    prompts: list[str],
    fault: Fault | None,
    fault_after: int,
    baseline: dict[int, str] | None,
    name: str,
    target: str,
    disconnects: int = 0,
    seed: int = 0,
    steady: bool = False,
) -> tuple[DrillReport, list[StreamResult]]:
    """Starts every prompt at once; causes `fault` once `fault_after` of them are streaming.
    `steady`: each prompt is sent again, in a new conversation, as soon as its reply ends, until
    the fault is over, so the load lasts as long as the fault does."""
    started_s = time.monotonic()
    streaming = [asyncio.Event() for _ in prompts]
    fault_over = asyncio.Event()
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts) * 2 + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(client.hang_s, connect=10.0), limits=limits) as http:

        async def one_slot(index: int, prompt: str, slot_rng: random.Random) -> list[StreamResult]:
            results = [await client.run(http, index, prompt, streaming[index], disconnects, slot_rng)]
            while steady and not fault_over.is_set():
                results.append(await client.run(http, index, prompt, None, disconnects, slot_rng))
            return results

        tasks = [asyncio.create_task(one_slot(i, p, random.Random(rng.random()))) for i, p in enumerate(prompts)]
        fault_text = "none"
        fault_unix_s = 0.0
        stack.healed_unix_s = 0.0
        try:
            if fault is not None:
                await _wait_started(streaming, fault_after, tasks, timeout_s=client.hang_s)
                fault_unix_s = round(time.time(), 3)
                fault_text = await fault(stack)
        finally:
            fault_over.set()
        results = [result for slot in await asyncio.gather(*tasks) for result in slot]
        stored = await _stored_statuses(http, client, results)
    report = DrillReport(name=name, fault=fault_text, num_replies=len(results), target=target)
    report.completed = sum(r.outcome == "complete" for r in results)
    report.errors = sum(r.outcome == "error" for r in results)
    report.hung = sum(r.outcome == "hung" for r in results)
    report.refused = sum(r.outcome == "refused" for r in results)
    longest = max(results, key=lambda r: r.longest_pause_s, default=None)
    report.longest_pause_s = round(longest.longest_pause_s, 2) if longest is not None else 0.0
    report.longest_pause_ended_unix_s = longest.longest_pause_ended_unix_s if longest is not None else 0.0
    report.fault_unix_s = fault_unix_s
    if stack.healed_unix_s:
        report.healed_unix_s = round(stack.healed_unix_s, 3)
        waits = [wait for r in results if (wait := r.wait_after(stack.healed_unix_s)) is not None]
        report.pause_after_heal_s = max(waits, default=0.0)
    report.longest_ttft_s = round(max((r.ttft_s for r in results), default=0.0), 2)
    report.ids_contiguous = all(r.ids_contiguous for r in results)
    report.stored = stored
    report.error_samples = sorted({r.error for r in results if r.error})[:5]
    if baseline is not None:
        report.texts_identical = sum(r.outcome == "complete" and r.text == baseline.get(r.index) for r in results)
        complete = [r for r in results if r.outcome == "complete"]
        report.texts_without_baseline = [r.index for r in complete if r.index not in baseline]
        report.texts_differing = [r.index for r in complete if r.index in baseline and r.text != baseline[r.index]]
    report.seconds = round(time.monotonic() - started_s, 1)
    return report, results


async def _wait_started(
    streaming: list[asyncio.Event], count: int, tasks: list[asyncio.Task[list[StreamResult]]], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(e.is_set() for e in streaming) < min(count, len(streaming)):
        if time.monotonic() > deadline or all(t.done() for t in tasks):
            return
        waiters = [asyncio.ensure_future(e.wait()) for e in streaming if not e.is_set()]
        await asyncio.wait(waiters, timeout=min(1.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()


async def _stored_statuses(http: httpx.AsyncClient, client: Client, results: list[StreamResult]) -> dict[str, int]:
    """The stored assistant turns' statuses, once the relay has had a moment to store the last."""
    counts: dict[str, int] = {}
    deadline = time.monotonic() + 15.0
    while True:
        counts = {}
        for result in results:
            if not result.conversation_id:
                continue
            try:
                answer = await http.get(f"{client.urls[0]}/v1/conversations/{result.conversation_id}", headers=client.headers)
                turns = answer.json().get("messages", []) if answer.status_code == 200 else []
            except (httpx.HTTPError, ValueError):
                turns = []
            statuses = [t["status"] for t in turns if t.get("role") == "assistant"]
            status = statuses[-1] if statuses else "missing"
            counts[status] = counts.get(status, 0) + 1
        if "running" not in counts or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.5)


async def main(args: argparse.Namespace) -> int:
    chosen = [d for d in args.drills.split(",") if d]
    every = plans(args)
    unknown = [d for d in chosen if d not in every]
    if unknown:
        print(f"unknown drill(s) {', '.join(unknown)}; choose from {', '.join(every)}", file=sys.stderr)
        return 2
    stack = DrillStack(
        decode_workers=2,
        prefill_workers=1,
        chat_instances=2,
        extra_env=_stack_env(args),
        api_keys=STORM_KEYS,
        tensor_parallel_size=args.tensor_parallel_size,
        separate_hosts=args.hosts or any(name in HOST_DRILLS for name in chosen),
        ha=args.ha or any(name in HA_DRILLS for name in chosen),
    )
    reports: list[DrillReport] = []
    async with stack:
        client = Client(urls=stack.chat_urls, key=stack.api_key, max_tokens=args.max_tokens, hang_s=args.hang_s)
        baselines: dict[bool, dict[int, str]] = {}
        baseline_pauses: dict[bool, float] = {}
        for name in chosen:
            plan = every[name]
            await stack.wait_all_ready(timeout_s=300.0)
            if plan.own_run is not None:
                report = await plan.own_run(stack, args)
                report.met = met(report, plan)
                reports.append(report)
                print_row(report)
                continue
            prompts = [prompt_of(i, plan.long_prompts) for i in range(plan.num_streams)]
            if plan.check_texts and plan.long_prompts not in baselines:
                count = max(
                    p.num_streams
                    for p in every.values()
                    if p.own_run is None and p.check_texts and p.long_prompts == plan.long_prompts and p.name in chosen
                )
                all_prompts = [prompt_of(i, plan.long_prompts) for i in range(count)]
                undisturbed, results = await run_load(stack, client, all_prompts, None, 0, None, "undisturbed", "")
                baselines[plan.long_prompts] = {r.index: r.text for r in results if r.outcome == "complete"}
                baseline_pauses[plan.long_prompts] = undisturbed.longest_pause_s
                print(
                    f"undisturbed run: {undisturbed.completed}/{undisturbed.num_replies} complete in {undisturbed.seconds} s, "
                    f"longest pause {undisturbed.longest_pause_s} s",
                    flush=True,
                )
            baseline = baselines.get(plan.long_prompts) if plan.check_texts else None
            fault_after = max(1, plan.num_streams // 2)
            report, _ = await run_load(
                stack,
                client,
                prompts,
                plan.fault,
                fault_after,
                baseline,
                name,
                plan.target,
                plan.disconnects,
                seed=args.seed,
                steady=plan.steady,
            )
            report.undisturbed_longest_pause_s = baseline_pauses.get(plan.long_prompts) if plan.check_texts else None
            report.met = met(report, plan)
            reports.append(report)
            print_row(report)
        if args.log:
            Path(args.log).write_text(stack.logs(num_lines=1_000_000) + "\n")
    print_table(reports)
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in reports], indent=2) + "\n")
    return 0


async def until_terminated(run: Awaitable[int]) -> int:
    """`run`, cancelled on SIGTERM as Ctrl-C cancels it: the stack stops and its hosts'
    namespaces are removed either way (a killed run would leave them behind)."""
    task = asyncio.ensure_future(run)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        print("terminated: the stack is stopped", file=sys.stderr)
        return 143


def _stack_env(args: argparse.Namespace) -> dict[str, str]:
    # The drill key is plus: its stream limit must not refuse the resume drill's 40 at once.
    env = {"TANDEM_KV_CACHE_MIB": "256", "TANDEM_LOG_LEVEL": "warning", "TANDEM_STREAM_LIMIT_PLUS": "1000"}
    env.update(dict(item.split("=", 1) for item in args.env))
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drills", default="kill_decode,kill_prefill,kill_relay,restart_redis,pause_nats,rolling,resume,reconnect_storm")
    parser.add_argument("--streams", type=int, default=16, help="replies streaming during a drill (prefill and rolling use half)")
    parser.add_argument("--max-tokens", type=int, default=64, help="each greedy answer's length")
    parser.add_argument("--resume-streams", type=int, default=40, help="replies of the resume drill")
    parser.add_argument("--resume-drops", type=int, default=5, help="disconnects per reply in the resume drill")
    parser.add_argument("--storm-streams", type=int, default=2000, help="streams the reconnect storm holds on the instance it kills")
    parser.add_argument("--storm-replies", type=int, default=8, help="replies those streams read")
    parser.add_argument("--storm-tokens", type=int, default=400, help="each storm reply's max_tokens (long enough to outlast the storm)")
    parser.add_argument("--hang-s", type=float, default=HANG_S, help="a reply with no final event by then is hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks of each prefill and decode worker's engine (kill_decode_rank needs 2 or more)",
    )
    parser.add_argument(
        "--ha",
        action="store_true",
        help="the servers with failover, as `tandem up --ha` starts them (the kill_*_primary/node drills need it)",
    )
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="every process on a host of its own: a network namespace each (root; the partition drills need it)",
    )
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every service (repeatable)")
    parser.add_argument("--out", default="", help="write the reports as JSON here")
    parser.add_argument("--log", default="", help="copy the stack's log (every process's output) here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # uvloop: the reconnect storm's thousands of streams are read on this process's loop, beside the stack it drills.
    sys.exit(uvloop.run(until_terminated(main(parse_args()))))
