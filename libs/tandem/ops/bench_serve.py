"""`tandem bench serve`: load against an OpenAI-compatible chat endpoint (Tandem's, vLLM's, any)
or Tandem's own chat API, at a request rate (Poisson arrivals, seeded) or a fixed concurrency;
prints a table of throughput, TTFT / ITL / TPOT / e2e percentiles and errors, and writes JSON
and PNG plots. The same command and seed against two servers sends them the same load."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from tandem.errors import StartupError
from tandem.ops.bench_client import Endpoint, OpenAIChat, RequestResult, TandemChat, send
from tandem.ops.bench_report import format_table, report_json, summarize
from tandem.ops.workload import BenchRequest, arrival_offsets_s, chat_requests, random_requests

DEFAULT_BASE_URL = "http://127.0.0.1:8080/v1"


@dataclass(frozen=True)
class RunConfig:
    request_rate: float  # requests/s; inf: all at once
    max_concurrency: int | None
    seed: int
    burstiness: float
    request_timeout_s: float
    show_progress: bool


async def run_load(
    endpoint: Endpoint, http: httpx.AsyncClient, requests: list[BenchRequest], config: RunConfig
) -> tuple[list[RequestResult], float]:
    """Sends every request at its arrival time (holding it while `max_concurrency` are in flight);
    returns the results in request order and the run's duration in seconds."""
    offsets_s = arrival_offsets_s(len(requests), config.request_rate, config.seed, config.burstiness)
    in_flight = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)
    progress = tqdm(total=len(requests), disable=not config.show_progress, unit="req")
    started = time.perf_counter()

    async def one(request: BenchRequest, offset_s: float) -> RequestResult:
        await asyncio.sleep(max(0.0, started + offset_s - time.perf_counter()))
        async with in_flight:
            result = await send(endpoint, http, request, time.perf_counter() - started, config.request_timeout_s)
        progress.update(1)
        return result

    try:
        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets_s, strict=True)))
    finally:
        progress.close()
    return list(results), time.perf_counter() - started


async def first_model(http: httpx.AsyncClient) -> str:
    """The first model of GET {base}/models: what a run asks for when --model is not given."""
    try:
        response = await http.get("models")
    except httpx.HTTPError as exc:
        raise StartupError(f"cannot reach {http.base_url}models ({type(exc).__name__}): is the server up?") from None
    if response.status_code != 200:
        raise StartupError(f"GET {http.base_url}models answered {response.status_code}: {response.text[:200]}")
    models = response.json().get("data") or []
    if not models:
        raise StartupError(f"{http.base_url}models lists no model: pass --model")
    return str(models[0]["id"])


def _requests_of(args: argparse.Namespace) -> list[BenchRequest]:
    try:
        if args.dataset == "random":
            return random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
        return chat_requests(args.num_prompts, args.output_len, args.range_ratio, args.seed)
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def _check(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise StartupError(f"--num-prompts must be at least 1, not {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise StartupError(f"--max-concurrency must be at least 1, not {args.max_concurrency}")
    if not args.request_rate > 0:
        raise StartupError(f"--request-rate must be > 0 (or inf), not {args.request_rate}")
    if args.burstiness <= 0:
        raise StartupError(f"--burstiness must be > 0, not {args.burstiness}")
    if args.request_timeout_s <= 0:
        raise StartupError(f"--request-timeout-s must be > 0, not {args.request_timeout_s}")


async def _bench(args: argparse.Namespace) -> int:
    _check(args)
    requests = _requests_of(args)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout_s, connect=min(10.0, args.request_timeout_s))
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/") + "/", headers=headers, limits=limits, timeout=timeout) as http:
        endpoint: Endpoint
        if args.endpoint == "chat":
            model = args.model or "auto"
            endpoint = TandemChat(model=model, temperature=args.temperature)
        else:
            model = args.model or await first_model(http)
            endpoint = OpenAIChat(model=model, temperature=args.temperature, ignore_eos=args.ignore_eos)
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
        print(
            f"{len(requests)} requests ({args.dataset}) to {args.base_url} ({args.endpoint}, model {model}), "
            f"rate {rate}, concurrency {args.max_concurrency or 'unbounded'}, seed {args.seed}",
            flush=True,
        )
        config = RunConfig(
            args.request_rate, args.max_concurrency, args.seed, args.burstiness, args.request_timeout_s, not args.disable_tqdm
        )
        results, duration_s = await run_load(endpoint, http, requests, config)
    summary = summarize(results, duration_s)
    print(format_table(summary, args.label or f"{args.endpoint} bench: {model}"))
    if args.result_json:
        settings = {name: value for name, value in vars(args).items() if name not in ("run", "api_key", "command")}
        settings.update(model=model, request_rate=str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate)
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(report_json(summary, settings, results), indent=1) + "\n")
        print(f"results: {args.result_json}")
    if args.plots:
        from tandem.ops.bench_plots import write_plots  # matplotlib only when asked for

        for path in write_plots(results, Path(args.plots), args.label or model):
            print(f"plot: {path}")
    return 0 if summary.num_ok else 1


def _run(args: argparse.Namespace) -> int:
    if args.bench_command != "serve":
        raise StartupError("say what to bench: tandem bench serve --help")
    try:
        return asyncio.run(_bench(args))
    except KeyboardInterrupt:  # Ctrl-C: no summary of a run cut short
        print("interrupted", file=sys.stderr)
        return 130


def add_cli(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="load tests: tandem bench serve")
    bench.set_defaults(run=_run, bench_command=None)
    serve = bench.add_subparsers(dest="bench_command").add_parser(
        "serve",
        help="streamed chat load against an OpenAI-compatible endpoint (or Tandem's chat API)",
        description="Sends --num-prompts streamed chat requests at --request-rate (Poisson arrivals, seeded) or "
        "--max-concurrency, then prints throughput, TTFT, ITL, TPOT and end-to-end latency percentiles and errors. "
        "Works against any OpenAI-compatible server (vLLM, ...): the same command and --seed send them the same load.",
    )
    serve.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"the API root (default {DEFAULT_BASE_URL})")
    serve.add_argument("--api-key", help="bearer token (default: OPENAI_API_KEY)")
    serve.add_argument("--model", help="default: the first of GET /models (openai), auto (chat)")
    serve.add_argument(
        "--endpoint", choices=("openai", "chat"), default="openai", help="openai: /chat/completions; chat: Tandem's conversations API"
    )
    serve.add_argument(
        "--dataset", choices=("chat", "random"), default="chat", help="chat: the built-in chat set; random: --input-len words"
    )
    serve.add_argument("--num-prompts", type=int, default=100)
    serve.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson arrivals); inf: all at once")
    serve.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; below 1 burstier, above steadier")
    serve.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    serve.add_argument("--input-len", type=int, default=256, help="prompt length in tokens (about: one common word each)")
    serve.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    serve.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument("--ignore-eos", action="store_true", help="vLLM's extension: every reply runs to max_tokens")
    serve.add_argument("--request-timeout-s", type=float, default=300.0, help="a request still running then counts as timeout")
    serve.add_argument("--result-json", help="write the summary and every request here")
    serve.add_argument("--plots", help="write ttft.png, itl.png and throughput.png into this folder")
    serve.add_argument("--label", help="the table's and plots' title (default: the model)")
    serve.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
