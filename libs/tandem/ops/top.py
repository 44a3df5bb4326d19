"""`tandem top`: a live terminal view of a running stack for people without Grafana. Every
interval it asks the router for its workers (GET /workers, on the router's HTTP port), reads each
worker's, the router's and a chat instance's /metrics (on their ops ports: a worker's is in the
router's listing), and redraws one frame (plain ANSI: clear and print)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx

from tandem.config import DEFAULT_HTTP_PORTS
from tandem.errors import StartupError
from tandem.ops.top_frame import Metrics, Snapshot, WorkerView, render_frame
from tandem.runtime.ops_port import OPS_PORT_OFFSET

CLEAR = "\x1b[H\x1b[2J"


async def _metrics(http: httpx.AsyncClient, base_url: str, what: str, problems: list[str]) -> Metrics | None:
    try:
        response = await http.get(f"{base_url.rstrip('/')}/metrics")
        response.raise_for_status()
        return Metrics.parse(response.text)
    except (httpx.HTTPError, ValueError) as exc:  # unreachable, not 200, or not the exposition format
        problems.append(f"{what} metrics at {base_url}: {type(exc).__name__}")
        return None


async def _workers(http: httpx.AsyncClient, router_url: str, problems: list[str]) -> list[dict[str, object]]:
    """The router's listing, each with its role; empty (and a problem said) when it cannot be read."""
    try:
        response = await http.get(f"{router_url.rstrip('/')}/workers")
        response.raise_for_status()
        listing = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        problems.append(f"router at {router_url}: {type(exc).__name__} (point --router-url at it)")
        return []
    return [{**worker, "role": role} for role, workers in listing.items() for worker in workers]


async def _worker_view(http: httpx.AsyncClient, listed: dict[str, object], problems: list[str]) -> WorkerView:
    instance_id = str(listed.get("instance_id", "?"))
    http_url = listed.get("http_url")
    if isinstance(http_url, str) and http_url:
        metrics = await _metrics(http, http_url, instance_id, problems)
    else:
        metrics = None
        problems.append(f"{instance_id}: the router does not list its HTTP address")
    load = listed.get("load")
    return WorkerView(
        role=str(listed["role"]),
        instance_id=instance_id,
        is_ready=bool(listed.get("engine_ready")),
        load=float(load) if isinstance(load, int | float) else None,
        metrics=metrics,
    )


async def take_snapshot(http: httpx.AsyncClient, router_url: str, router_ops_url: str, chat_ops_url: str) -> Snapshot:
    problems: list[str] = []
    listed = await _workers(http, router_url, problems)
    chat, router, *workers = await asyncio.gather(
        _metrics(http, chat_ops_url, "chat", problems),
        _metrics(http, router_ops_url, "router", problems),
        *(_worker_view(http, w, problems) for w in listed),
    )
    return Snapshot(time.time(), chat, router, list(workers), problems)  # type: ignore[arg-type]


async def _top(args: argparse.Namespace) -> int:
    async with httpx.AsyncClient(timeout=args.timeout_s) as http:
        before = await take_snapshot(http, args.router_url, args.router_ops_url, args.chat_url)
        while True:
            await asyncio.sleep(args.interval)
            now = await take_snapshot(http, args.router_url, args.router_ops_url, args.chat_url)
            frame = render_frame(now, before, args.interval)
            if args.once:
                print(frame)
                return 0
            sys.stdout.write(CLEAR + frame + "\n")
            sys.stdout.flush()
            before = now


def _run(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise StartupError(f"--interval must be > 0, not {args.interval}")
    try:
        return asyncio.run(_top(args))
    except KeyboardInterrupt:
        return 0


def add_cli(commands: argparse._SubParsersAction) -> None:
    router_url = f"http://127.0.0.1:{DEFAULT_HTTP_PORTS['router']}"
    router_ops_url = f"http://127.0.0.1:{DEFAULT_HTTP_PORTS['router'] + OPS_PORT_OFFSET}"
    chat_url = f"http://127.0.0.1:{DEFAULT_HTTP_PORTS['chat'] + OPS_PORT_OFFSET}"
    parser = commands.add_parser(
        "top",
        help="a live view of the stack: workers, KV use, queues, tokens/s, TTFT p95",
        description="Redraws every --interval seconds from the router's GET /workers and the processes' /metrics (on their ops ports). "
        "Rates and percentiles cover the last interval (percentiles: since start until the interval has observations). "
        "A figure a process does not export shows as '-'. Ctrl-C quits.",
    )
    parser.add_argument("--router-url", default=router_url, help=f"the router's HTTP address, for GET /workers (default {router_url})")
    parser.add_argument(
        "--router-ops-url", default=router_ops_url, help=f"the router's ops address, for /metrics (default {router_ops_url})"
    )
    parser.add_argument("--chat-url", default=chat_url, help=f"a chat instance's ops address, for /metrics (default {chat_url})")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between frames (default 2)")
    parser.add_argument("--once", action="store_true", help="print one frame (after one interval, for its rates) and exit")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="per HTTP request")
    parser.set_defaults(run=_run)
