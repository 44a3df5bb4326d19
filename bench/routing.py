"""Small/large model routing (issue 13) on the whole local stack as `tandem up` runs it: the large
model's decode worker, the small model's (the same weights kept as int8), router, relay and chat.

A seeded mix of messages (greetings, chit-chat, code questions, reasoning; from
tandem.ops.chat_prompts and a few greetings) goes through the product API twice on the same stack,
each message in a new conversation, `--concurrency` at a time:

1. **auto**: `model: "auto"`, so the difficulty router picks the model of each message;
2. **all-large, the baseline**: the same messages with the large model named (a pro key's pick is
   honoured), so every one is answered by the large pool. Each run has its own user, so neither
   finds the other's prompts in the prefix cache (its blocks are namespaced by user).

Per run, and per model that answered in the auto run, it reports the share of messages, the
output tokens/s (output tokens over the sum of the replies' durations, request to `done`), the
median time to first token, the inter-token latency p50/p99 (the gaps between a stream's `delta`
events as this client reads them), and the cost per 1,000 messages: the answering model's
worker-hour price (flags; equal by default) times the measured seconds of worker time per message
(a reply's duration; at --concurrency 1 a worker serves one reply at a time, above it replies
share a batch and this over-counts). The point of routing is that auto costs less than all-large
at comparable quality, so it prints the ratio, and how many of auto's answers are the same greedy
text as the large model's answer to the same message.

The safety checks' added cost: the output check (tandem.safety's profanity-check, as the relay
runs it) is timed here, offline, on windows of the auto run's real answers
(`output_check_window_chars` of the newest text every `output_check_every_tokens` tokens), one
call at a time on one thread (about its CPU time on an idle machine): per call, and per streamed
token (a call's time over the tokens between calls); the input check is timed on each message.
The relay runs the output check off the token path (only a reply's last event waits for one
call), and it is on in both runs, so the inter-token latency includes it but does not isolate it.
The services' own histograms (tandem_relay_output_check_seconds, tandem_chat_input_check_seconds;
both runs) are read from /metrics too.

    .venv/bin/python bench/routing.py --out routing.json
    .venv/bin/python bench/routing.py --messages 16 --max-tokens 32      # a few minutes on a busy CPU
    .venv/bin/python bench/routing.py --quick                            # smoke sizes
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import mark, percentile, write_json
from prometheus_client.parser import text_string_to_metric_families

from tandem.config import ApiKey, Tier, load_settings
from tandem.devstack.proc import free_ports
from tandem.devstack.stack import Console, Stack, stack_config_from
from tandem.ops.chat_prompts import chat_set
from tandem.safety import PROFANITY_CHECK, TextCheck, load_check

AUTO_KEY, LARGE_KEY = "bench-routing-auto", "bench-routing-large"
KEYS = {AUTO_KEY: ApiKey(user_id="bencher-auto", tier=Tier.PRO), LARGE_KEY: ApiKey(user_id="bencher-large", tier=Tier.PRO)}
GREETINGS = ("Hi!", "Hello there.", "Good morning!", "Hey, how are you?", "Thanks, that helped!", "Hi, nice to meet you.")
KINDS = ("greeting", "chit-chat", "code", "reasoning")
WEIGHTS = (0.25, 0.3, 0.2, 0.25)
CODE_MARKS = ("def ", "for i in", "Python", "SQL", "function", "hash table")
READY_TIMEOUT_S = 600.0
REPLY_TIMEOUT_S = 600.0


@dataclass
class Reply:
    kind: str
    model: str = ""
    decided_by: str = ""
    output_tokens: int = 0
    duration_s: float = 0.0  # request to done
    ttft_s: float = 0.0
    deltas: list[str] = field(default_factory=list)  # one per token event
    delta_at_s: list[float] = field(default_factory=list)  # when each delta arrived, from the request

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.delta_at_s, self.delta_at_s[1:])]


def message_pool() -> dict[str, list[str]]:
    """The set's single-message conversations by kind, plus greetings."""
    texts = [conversation[-1]["content"] for conversation in chat_set() if len(conversation) == 1]
    code = [t for t in texts if any(mark in t for mark in CODE_MARKS)]
    rest = [t for t in texts if t not in code]
    return {
        "greeting": list(GREETINGS),
        "chit-chat": [t for t in rest if len(t) < 90],
        "code": code,
        "reasoning": [t for t in rest if len(t) >= 90],
    }


def seeded_mix(num_messages: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pool = message_pool()
    kinds = rng.choices(KINDS, weights=WEIGHTS, k=num_messages)
    return [(kind, rng.choice(pool[kind])) for kind in kinds]


async def send(http: httpx.AsyncClient, kind: str, content: str, model: str, max_tokens: int) -> Reply:
    """One message asking for `model` in a new conversation, read to its `done`."""
    conversation = (await http.post("/v1/conversations", json={})).json()["id"]
    body = {"content": content, "model": model, "temperature": 0, "max_tokens": max_tokens}
    started_s = time.monotonic()
    reply = Reply(kind)
    event = ""
    async with http.stream("POST", f"/v1/conversations/{conversation}/messages", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
                continue
            if not line.startswith("data: "):
                continue
            data = json.loads(line.removeprefix("data: "))
            if event == "meta":
                reply.model = data["model"]
                reply.decided_by = (data.get("route") or {}).get("decided_by", "")
            elif event == "delta":
                reply.delta_at_s.append(time.monotonic() - started_s)
                reply.deltas.append(data["text"])
            elif event == "done":
                reply.output_tokens = data["usage"]["output"]
                reply.model = data.get("model") or reply.model  # the model that wrote it
                break
            elif event in ("error", "moderated"):
                raise RuntimeError(f"{event}: {data}")
    reply.duration_s = time.monotonic() - started_s
    reply.ttft_s = reply.delta_at_s[0] if reply.delta_at_s else reply.duration_s
    return reply


async def send_all(url: str, key: str, model: str, mix: Sequence[tuple[str, str]], max_tokens: int, concurrency: int) -> list[Reply]:
    """The mix in order (each reply at its message's index), `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {key}", "Accept": "text/event-stream"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=REPLY_TIMEOUT_S) as http:

        async def one(kind: str, content: str) -> Reply:
            async with gate:
                return await send(http, kind, content, model, max_tokens)

        return list(await asyncio.gather(*(one(kind, content) for kind, content in mix)))


def summarize(replies: Sequence[Reply], hour_cost: dict[str, float]) -> dict[str, Any]:
    """Speed and cost of a set of replies; each one's worker time is priced at its own model's rate."""
    seconds = sum(r.duration_s for r in replies)
    tokens = sum(r.output_tokens for r in replies)
    gaps_s = [gap for r in replies for gap in r.gaps_s()]
    cost_per_message = statistics.fmean(r.duration_s * hour_cost[r.model] / 3600 for r in replies)
    return {
        "messages": len(replies),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds if seconds else 0.0,
        "ttft_p50_s": statistics.median(r.ttft_s for r in replies),
        "itl_p50_ms": 1000 * percentile(gaps_s, 50) if gaps_s else None,
        "itl_p99_ms": 1000 * percentile(gaps_s, 99) if gaps_s else None,
        "worker_s_per_message": seconds / len(replies),
        "cost_per_1000_messages": 1000 * cost_per_message,
    }


def per_model(replies: Sequence[Reply], baseline: Sequence[Reply], hour_cost: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The auto run by answering model; `same_text_as_baseline`: its answers that are the large
    model's greedy answer to the same message, word for word."""
    rows: dict[str, dict[str, Any]] = {}
    for model in sorted({r.model for r in replies}):
        pairs = [(r, b) for r, b in zip(replies, baseline, strict=True) if r.model == model]
        mine = [r for r, _ in pairs]
        rows[model] = {
            "share": len(mine) / len(replies),
            "by_kind": {kind: sum(1 for r in mine if r.kind == kind) for kind in KINDS},
            "decided_by": {d: sum(1 for r in mine if r.decided_by == d) for d in sorted({r.decided_by for r in mine})},
            "worker_hour_cost": hour_cost[model],
            "same_text_as_baseline": sum(r.text == b.text for r, b in pairs),
            **summarize(mine, hour_cost),
        }
    return rows


def time_checks(check: TextCheck, replies: Sequence[Reply], mix: Sequence[tuple[str, str]], every: int, window: int) -> dict[str, Any]:
    """The output check on windows of the real answers as the relay reads them, and the input
    check on each message, one call at a time on this process's thread: seconds per call, and the
    output check's per streamed token (a call's time over the tokens between calls)."""
    windows = []
    for reply in replies:
        text = ""
        for num_tokens, delta in enumerate(reply.deltas, start=1):
            text += delta
            if num_tokens % every == 0 or num_tokens == len(reply.deltas):
                windows.append(text[-window:])
    check.score(["warm up"])
    window_s = [_timed(check, w) for w in windows]
    input_s = [_timed(check, content) for _, content in mix]
    mean_window_s = statistics.fmean(window_s) if window_s else 0.0
    return {
        "check": check.name,
        "every_tokens": every,
        "window_chars": window,
        "windows_scored": len(windows),
        "output_window_ms_mean": 1000 * mean_window_s,
        "output_window_ms_p95": 1000 * _p95(window_s),
        "output_ms_per_token": 1000 * mean_window_s / every,
        "input_ms_mean": 1000 * statistics.fmean(input_s),
        "input_ms_p95": 1000 * _p95(input_s),
    }


def _timed(check: TextCheck, text: str) -> float:
    started_s = time.perf_counter()
    check.score([text])
    return time.perf_counter() - started_s


def _p95(values: Sequence[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.95 * len(values)))] if values else 0.0


async def service_histograms(stack: Stack) -> dict[str, Any]:
    """The check-latency histograms the services export (sum and count; absent: not exported)."""
    found: dict[str, Any] = {}
    wanted = {"relay": "tandem_relay_output_check_seconds", "chat": "tandem_chat_input_check_seconds"}
    async with httpx.AsyncClient(timeout=10) as http:
        for role, name in wanted.items():
            text = (await http.get(f"{stack.members_of(role)[0].ops_url}/metrics")).text
            for family in text_string_to_metric_families(text):
                if family.name != name:
                    continue
                values = {s.name.removeprefix(name): s.value for s in family.samples if s.name in (f"{name}_sum", f"{name}_count")}
                count = values.get("_count", 0.0)
                found[name] = {"count": count, "mean_ms": 1000 * values.get("_sum", 0.0) / count if count else None}
    return found


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{result['messages']} messages (seed {result['seed']}, max_tokens {result['max_tokens']}, "
        f"concurrency {result['concurrency']}), sent twice on one stack: auto, then all to {result['large_model']}"
    )
    print(
        f"{'run / answering model':<44} {'share':>6} {'msgs':>5} {'out tok':>8} {'tok/s':>7} {'ttft p50':>9} "
        f"{'itl p50':>8} {'itl p99':>8} {'s/msg':>7} {'cost/1k msgs':>13}"
    )

    def row(label: str, share: float, r: dict[str, Any]) -> None:
        itl = [f"{r[k]:>6.1f}ms" if r[k] is not None else f"{'-':>8}" for k in ("itl_p50_ms", "itl_p99_ms")]
        print(
            f"{label:<44} {share:>6.0%} {r['messages']:>5} {r['output_tokens']:>8} {r['output_tokens_per_s']:>7.1f} "
            f"{r['ttft_p50_s']:>8.2f}s {itl[0]} {itl[1]} {r['worker_s_per_message']:>7.2f} {r['cost_per_1000_messages']:>13.4f}"
        )

    for model, r in result["models"].items():
        row(f"auto: {model}", r["share"], r)
    row("auto: all", 1.0, result["aggregate"])
    row(f"all-large (baseline): {result['large_model']}", 1.0, result["baseline"])
    ratio = result["cost_ratio_auto_over_baseline"]
    print(
        f"cost per 1,000 messages: auto {result['aggregate']['cost_per_1000_messages']:.4f} vs all-large "
        f"{result['baseline']['cost_per_1000_messages']:.4f} = {ratio:.2f}x   {mark(ratio < 1)} auto costs less"
    )
    print(
        "same greedy text as all-large's answer: "
        + "; ".join(f"{m}: {r['same_text_as_baseline']} / {r['messages']}" for m, r in result["models"].items())
    )
    print("by kind: " + "; ".join(f"{m}: {r['by_kind']}" for m, r in result["models"].items()))
    checks = result["safety"]
    print(
        f"safety checks ({checks['check']}): the time of one call, on one thread, timed here offline on the auto run's "
        "answers and its messages"
    )
    print(
        f"  output check: a {checks['window_chars']}-char window every {checks['every_tokens']} tokens "
        f"({checks['windows_scored']} windows): {checks['output_window_ms_mean']:.2f} ms per call (p95 "
        f"{checks['output_window_ms_p95']:.2f}) = {checks['output_ms_per_token']:.3f} ms per streamed token, "
        "in the relay's check process, off the token path"
    )
    print(
        f"  input check: each message: {checks['input_ms_mean']:.2f} ms per call (p95 {checks['input_ms_p95']:.2f}), "
        "beside context assembly"
    )
    print("  the services' own histograms (wall time, both runs):")
    for name, hist in result["service_histograms"].items():
        mean = "n/a" if hist["mean_ms"] is None else f"{hist['mean_ms']:.2f} ms mean"
        print(f"    {name}: {int(hist['count'])} calls, {mean}")


async def main(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="tandem-routing-"))
    settings = load_settings(["--small-decode-workers", "1", "--prefill-workers", "0"], prog="tandem up")
    config = stack_config_from(settings, chat_port=free_ports(1))
    env = {**config.extra_env, "TANDEM_STORE": "sqlite", "TANDEM_SQLITE_PATH": str(workdir / "conversations.db")}
    env |= dict(pair.split("=", 1) for pair in args.env)
    config = dataclasses.replace(config, api_keys=KEYS, extra_env=env, ready_timeout_s=READY_TIMEOUT_S)
    large, small = env["TANDEM_LARGE_MODEL"], env["TANDEM_SMALL_MODEL"]
    mix = seeded_mix(args.messages, args.seed)
    log_path = Path(args.log) if args.log else workdir / "stack.log"
    started_s = time.monotonic()
    with log_path.open("w") as log:
        async with Stack(config, Console(log)) as stack:
            url = stack.chat_urls[0]
            print(f"stack up (log: {log_path}); {large} large, {small} small; sending {len(mix)} messages twice", flush=True)
            warm_up = [("greeting", GREETINGS[0]), ("code", message_pool()["code"][0])]  # one for each model, untimed
            await send_all(url, AUTO_KEY, "auto", warm_up, 4, 1)
            replies = await send_all(url, AUTO_KEY, "auto", mix, args.max_tokens, args.concurrency)
            baseline = await send_all(url, LARGE_KEY, large, mix, args.max_tokens, args.concurrency)
            histograms = await service_histograms(stack)
    check = load_check(PROFANITY_CHECK)
    assert check is not None
    hour_cost = {large: args.large_hour_cost, small: args.small_hour_cost}
    hour_cost |= {r.model: args.large_hour_cost for r in (*replies, *baseline) if r.model not in hour_cost}
    aggregate, baseline_row = summarize(replies, hour_cost), summarize(baseline, hour_cost)
    result = {
        "messages": len(replies),
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "large_model": large,
        "small_model": small,
        "models": per_model(replies, baseline, hour_cost),
        "aggregate": aggregate,
        "baseline": {
            "model": large,
            "answered_by": {m: sum(1 for r in baseline if r.model == m) for m in sorted({r.model for r in baseline})},
            **baseline_row,
        },
        "cost_ratio_auto_over_baseline": aggregate["cost_per_1000_messages"] / baseline_row["cost_per_1000_messages"],
        "safety": time_checks(check, replies, mix, settings.output_check_every_tokens, settings.output_check_window_chars),
        "service_histograms": histograms,
        "elapsed_s": time.monotonic() - started_s,
    }
    print_table(result)
    print(f"bench took {result['elapsed_s']:.0f} s")
    write_json(Path(args.out) if args.out else None, result)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=40, help="messages in the seeded mix")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--max-tokens", type=int, default=64, help="each answer's max_tokens (greedy)")
    parser.add_argument("--concurrency", type=int, default=1, help="messages in flight at once")
    parser.add_argument("--large-hour-cost", type=float, default=1.0, help="one large-model worker's hourly price")
    parser.add_argument("--small-hour-cost", type=float, default=1.0, help="one small-model worker's hourly price")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every service (repeatable)")
    parser.add_argument("--out", default="", help="write the numbers as JSON here")
    parser.add_argument("--log", default="", help="write the stack's log (every process's output) here")
    parser.add_argument("--quick", action="store_true", help="smoke sizes: 6 messages of at most 16 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.messages, args.max_tokens = 6, 16
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
