"""What the serving stack costs on top of the engine, for one streamed reply at a time.

Two sides, alternating in one run so that the machine's noise hits both alike:

1. **the stack**: the local stack as `tandem up` starts it (its settings and members: nats, redis,
   router, relay, chat, a decode worker of the large model, a prefill worker and a small-model
   decode worker; the workers' torch threads as `tandem up` shares the cores), and one streamed
   `POST /v1/chat/completions` (temperature 0, `--max-tokens`, the large model named with a pro
   key) read by an OpenAI client (tandem.ops.bench_client): TTFT from sending the request to the
   first content delta, TPOT = (last content delta - first) / (tokens - 1), tokens from the usage
   chunk.
2. **the engine alone**, in this process: the engine the stack's decode worker runs, built here
   from that worker's environment as the worker builds it (model file, dtype, device,
   quantization, engine config, torch threads), given the very same prompt token ids (the message
   chat-templated as the chat service does; the stack's usage counts them) with the same greedy
   sampling, timed per token as the engine benches do (bench/common.run_timed).

After `--warmup` replies on each side, `--requests` rounds of (stack reply, engine reply). Both
sides run the same prompt each time for the same tenant, so both serve it from a warm prefix cache.
It prints p50/p95 of TTFT and TPOT per side, the TPOT ratio stack / engine (target <= 1.1x) and the
TTFT difference stack - engine (target <= +15 ms), both on the p50s, as information (PASS/MISS, never
an exit code); and, from the services' /metrics over the timed rounds, the mean of each stage a
reply passes, to tell where the stack's extra time goes.

    .venv/bin/python bench/stack_overhead.py --out overhead.json
    .venv/bin/python bench/stack_overhead.py --quick        # smoke sizes
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from common import mark, percentile, run_timed, set_threads, write_json

from tandem.config import ApiKey, Tier, load_settings
from tandem.devstack.members import SMALL_POOL, Member
from tandem.devstack.proc import free_ports
from tandem.devstack.stack import Console, Stack, StackConfig, stack_config_from
from tandem.engine.engine import Engine, Request
from tandem.engine.sequence import Lane, SamplingOptions
from tandem.kernels import select_attention
from tandem.models.files import open_model
from tandem.models.loader import LoadedModel, load_model
from tandem.ops.bench_client import OpenAIChat, send
from tandem.ops.top_frame import Metrics
from tandem.ops.workload import BenchRequest
from tandem.worker.engine_spec import EngineSpec

USER = "bencher-overhead"
KEY = "bench-stack-overhead"
KEYS = {KEY: ApiKey(user_id=USER, tier=Tier.PRO)}  # a paid user's named model is the one that answers
MESSAGES = ({"role": "user", "content": "Please explain how a bicycle stays upright while it is moving."},)  # 42 tokens templated
TPOT_RATIO_TARGET = 1.1
TTFT_DIFF_TARGET_MS = 15.0
READY_TIMEOUT_S = 600.0
REPLY_TIMEOUT_S = 300.0
# The settings a worker's engine is built from (tandem.worker.parts: open_model, EngineSpec.from_settings).
ENGINE_SETTINGS = (
    "model_path", "served_model_name", "quantization", "device", "dtype", "kv_cache_mib", "max_num_seqs",
    "max_num_batched_tokens", "max_num_prefill_only_batched_tokens", "max_num_unpaid_batched_tokens", "torch_threads",
    "cpu_affinity",
)  # fmt: skip
# Where a reply's time goes in the stack: (row, role, histogram, labels), over the timed rounds.
STAGES: tuple[tuple[str, str, str, dict[str, str]], ...] = (
    ("chat: arrival to first content written", "chat", "tandem_chat_time_to_first_token_seconds", {}),
    ("router: admission to worker's acceptance", "router", "tandem_router_dispatch_seconds", {}),
    ("worker: engine queue wait", "decode", "tandem_worker_queue_wait_seconds", {}),
    ("worker: step, prefill only", "decode", "tandem_worker_step_seconds", {"kind": "prefill"}),
    ("worker: step, mixed", "decode", "tandem_worker_step_seconds", {"kind": "mixed"}),
    ("worker: step, decode only", "decode", "tandem_worker_step_seconds", {"kind": "decode"}),
    ("chat: between content writes", "chat", "tandem_chat_inter_token_latency_seconds", {}),
    ("relay: output check call", "relay", "tandem_relay_output_check_seconds", {}),
)


@dataclass(frozen=True)
class Reply:
    """One reply as its reader saw it."""

    ttft_ms: float
    tpot_ms: float
    num_tokens: int
    num_prompt_tokens: int


def stack_config(args: argparse.Namespace, workdir: Path) -> StackConfig:
    """`tandem up`'s stack with no flags, with this bench's key, the store in `workdir` and `--env`."""
    config = stack_config_from(load_settings([], prog="tandem up"), chat_port=free_ports(1))
    env = {**config.extra_env, "TANDEM_SQLITE_PATH": str(workdir / "conversations.db")}
    env |= dict(pair.split("=", 1) for pair in args.env)
    return dataclasses.replace(config, api_keys=KEYS, extra_env=env, ready_timeout_s=READY_TIMEOUT_S)


def large_decode_worker(stack: Stack) -> Member:
    return next(m for m in stack.members_of("decode") if not m.instance_id.startswith(SMALL_POOL))


def worker_spec(env: Mapping[str, str]) -> EngineSpec:
    """The spec of the engine a worker with environment `env` builds, read from the same variables."""
    given = {name: env[f"TANDEM_{name.upper()}"] for name in ENGINE_SETTINGS if f"TANDEM_{name.upper()}" in env}
    settings = load_settings(None, **given)
    return EngineSpec.from_settings(
        settings, open_model(settings.model_path, settings.served_model_name, settings.quantization, settings.model_version)
    )


def load_worker_model(spec: EngineSpec) -> LoadedModel:
    """As the worker's engine thread loads it (EngineHost), its torch threads set on this thread,
    which steps the engine."""
    set_threads(spec.torch_threads)
    return load_model(spec.model.path, spec.dtype, spec.device, select_attention(spec.device), spec.model.quantization)


async def stack_reply(http: httpx.AsyncClient, endpoint: OpenAIChat, request: BenchRequest) -> Reply:
    result = await send(endpoint, http, request, started_s=0.0, timeout_s=REPLY_TIMEOUT_S)
    if not result.ok or result.ttft_s is None or result.prompt_tokens is None:
        raise RuntimeError(f"the stack's reply failed: {result.error} (usage counted: {result.is_usage_counted})")
    deltas_s = result.delta_offsets_s
    tpot_ms = 1e3 * (deltas_s[-1] - deltas_s[0]) / max(1, result.output_tokens - 1)
    return Reply(1e3 * result.ttft_s, tpot_ms, result.output_tokens, result.prompt_tokens)


def engine_reply(engine: Engine, prompt_ids: Sequence[int], max_tokens: int, index: int) -> Reply:
    """The chat's request as the worker hands it to its engine (tandem.worker.wire): a paid lane, the user as tenant."""
    request = Request(
        f"engine-{index}", tuple(prompt_ids), SamplingOptions(temperature=0.0, max_tokens=max_tokens),
        lane=Lane.PAID, tenant=USER, user_id=USER,
    )  # fmt: skip
    timing = run_timed(engine, [request])[request.request_id]
    return Reply(timing.ttft_ms, timing.tpot_ms, timing.num_output_tokens, len(prompt_ids))


async def scrape(http: httpx.AsyncClient, members: Mapping[str, Sequence[Member]]) -> dict[str, list[Metrics]]:
    return {role: [Metrics.parse((await http.get(f"{m.ops_url}/metrics")).text) for m in group] for role, group in members.items()}


def stages(before: dict[str, list[Metrics]], after: dict[str, list[Metrics]]) -> dict[str, dict[str, float | None]]:
    """Each stage's observations between the two scrapes: count and mean."""
    rows: dict[str, dict[str, float | None]] = {}
    for row, role, name, labels in STAGES:
        count = total_s = 0.0
        for earlier, now in zip(before[role], after[role], strict=True):
            count += (now.total(f"{name}_count", **labels) or 0.0) - (earlier.total(f"{name}_count", **labels) or 0.0)
            total_s += (now.total(f"{name}_sum", **labels) or 0.0) - (earlier.total(f"{name}_sum", **labels) or 0.0)
        rows[row] = {"count": count, "mean_ms": 1e3 * total_s / count if count else None}
    return rows


def side(replies: Sequence[Reply]) -> dict[str, Any]:
    return {
        "ttft_p50_ms": percentile((r.ttft_ms for r in replies), 50),
        "ttft_p95_ms": percentile((r.ttft_ms for r in replies), 95),
        "tpot_p50_ms": percentile((r.tpot_ms for r in replies), 50),
        "tpot_p95_ms": percentile((r.tpot_ms for r in replies), 95),
        "num_tokens": [r.num_tokens for r in replies],
    }


async def measure(args: argparse.Namespace, stack: Stack) -> dict[str, Any]:
    """Warm-ups, then the alternating rounds; the report without the bench's elapsed time."""
    decode = large_decode_worker(stack)
    spec = worker_spec(decode.env)
    loaded = load_worker_model(spec)
    engine = Engine(loaded, spec.engine)
    prompt_ids = loaded.tokenizer.encode_chat(list(MESSAGES))
    endpoint, request = OpenAIChat(model=spec.model.name), BenchRequest(MESSAGES, args.max_tokens)
    members = {role: stack.members_of(role) for role in ("chat", "router", "relay")} | {"decode": [decode]}
    print(
        f"stack up; {spec.model.name} ({spec.dtype}, quantization {spec.model.quantization}) on {spec.device}, "
        f"{spec.torch_threads or 'default'} torch threads; {len(prompt_ids)} prompt tokens; "
        f"{args.warmup} warm-up and {args.requests} timed rounds of (stack, engine)",
        flush=True,
    )
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=f"{stack.chat_urls[0]}/v1/", headers=headers, timeout=REPLY_TIMEOUT_S) as http:
        for index in range(args.warmup):
            await stack_reply(http, endpoint, request)
            engine_reply(engine, prompt_ids, args.max_tokens, -1 - index)
        before = await scrape(http, members)
        rounds = []
        for index in range(args.requests):
            rounds.append((await stack_reply(http, endpoint, request), engine_reply(engine, prompt_ids, args.max_tokens, index)))
        after = await scrape(http, members)
    stack_side, engine_side = side([s for s, _ in rounds]), side([e for _, e in rounds])
    tpot_ratio = stack_side["tpot_p50_ms"] / engine_side["tpot_p50_ms"]
    ttft_diff_ms = stack_side["ttft_p50_ms"] - engine_side["ttft_p50_ms"]
    return {
        "model": spec.model.name,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "quantization": spec.model.quantization,
        "device": spec.device,
        "torch_threads": spec.torch_threads,
        "num_prompt_tokens": len(prompt_ids),
        "max_tokens": args.max_tokens,
        "num_warmup": args.warmup,
        "num_requests": args.requests,
        "stack": stack_side,
        "engine": engine_side,
        "tokens_equal": all(s.num_tokens == e.num_tokens for s, e in rounds),
        "prompt_tokens_equal": all(s.num_prompt_tokens == e.num_prompt_tokens for s, e in rounds),
        "tpot_ratio": tpot_ratio,
        "ttft_diff_ms": ttft_diff_ms,
        "targets": {"tpot_ratio": tpot_ratio <= TPOT_RATIO_TARGET, "ttft_diff": ttft_diff_ms <= TTFT_DIFF_TARGET_MS},
        "stages": stages(before, after),
        "rounds": [{"stack": asdict(s), "engine": asdict(e)} for s, e in rounds],
    }


def print_table(result: dict[str, Any]) -> None:
    stack_side, engine_side = result["stack"], result["engine"]
    print(
        f"\nstack overhead: {result['num_requests']} rounds of one streamed reply through the stack, then one from the "
        f"engine alone; {result['model']} ({result['dtype']}, {result['torch_threads']} torch threads), "
        f"{result['num_prompt_tokens']} prompt tokens, max_tokens {result['max_tokens']}, greedy"
    )
    print(f"{'':<16}{'stack':>10}{'engine':>10}{'stack - engine':>16}{'stack / engine':>16}")
    for name in ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms"):
        s, e = stack_side[name], engine_side[name]
        label = f"{name[:4].upper()} {name[5:8]} ms"
        print(f"{label:<16}{s:>10.2f}{e:>10.2f}{s - e:>+16.2f}{s / e:>15.3f}x")
    tokens = f"{min(stack_side['num_tokens'])}-{max(stack_side['num_tokens'])}"
    same = "same in every round" if result["tokens_equal"] else "DIFFERENT in some rounds (see the JSON's rounds)"
    print(f"{'tokens/reply':<16}{tokens:>10}{'':>10}  {same}")
    if not result["prompt_tokens_equal"]:
        print("the stack's usage counts a different prompt length than the engine was given (see the JSON's rounds)")
    targets = result["targets"]
    print(f"{mark(targets['tpot_ratio'])} TPOT p50 stack / engine {result['tpot_ratio']:.3f}x <= {TPOT_RATIO_TARGET}x")
    print(f"{mark(targets['ttft_diff'])} TTFT p50 stack - engine {result['ttft_diff_ms']:+.1f} ms <= +{TTFT_DIFF_TARGET_MS:.0f} ms")
    print(f"\n{'where the stack spent time (its /metrics, timed rounds)':<58}{'count':>7}{'mean ms':>10}")
    for row, figures in result["stages"].items():
        mean = "-" if figures["mean_ms"] is None else f"{figures['mean_ms']:.2f}"
        print(f"  {row:<56}{figures['count']:>7.0f}{mean:>10}")


async def main(args: argparse.Namespace) -> int:
    started_s = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="tandem-overhead-"))
    log_path = Path(args.log) if args.log else workdir / "stack.log"
    print(f"starting the stack as tandem up does (log: {log_path})", flush=True)
    with log_path.open("w") as log:
        try:
            async with Stack(stack_config(args, workdir), Console(log)) as stack:
                result = await measure(args, stack)
        except BaseException:
            print(f"failed; the stack's log: {log_path}", file=sys.stderr)
            raise
    result["elapsed_s"] = time.monotonic() - started_s
    print_table(result)
    print(f"bench took {result['elapsed_s']:.0f} s")
    write_json(Path(args.out) if args.out else None, result)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20, help="timed rounds, each a stack reply then an engine reply")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--max-tokens", type=int, default=64, help="each reply's max_tokens (greedy)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every service and the engine (repeatable)")
    parser.add_argument("--out", default="", help="write the numbers as JSON here")
    parser.add_argument("--log", default="", help="write the stack's log (every process's output) here")
    parser.add_argument("--quick", action="store_true", help="smoke sizes: 1 warm-up and 3 timed rounds of 16 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.max_tokens = 3, 1, 16
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
