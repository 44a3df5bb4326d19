"""Streaming at scale on one chat instance (issue 12): N SSE streams (default 10,000) spread over
a few long replies, opened from several client processes (bench/stream_clients.py), against a
whole local stack (`tandem up`'s Stack: nats, redis, router, relay, one decode worker, one chat).

It reports the streams held at once, the streams whose events equal their reply's full log (read
from Redis at the end), p50/p99 delay from the relay's log write (seen by one XREAD per reply in
this process) to delivery (seen by the clients; the same machine clock), events/s delivered, the
chat process's RSS per stream and file descriptors (peak, and after every stream closed), and a
2x-capacity phase: a second chat instance with TANDEM_MAX_STREAMS=capacity asked for 2x
streams answers 200 or 503 (with Retry-After), never 500. From the chat's /metrics: its event
loop's lag, its passes' time, the delay from a token's production to its pass (the chat's side
of the delay, without the clients' reads), and its full GC passes. `--chat-cpus 0` gives the chat
CPU 0 alone and everything else the rest.

    .venv/bin/python bench/stream_fanout.py --out streams.json            # 10,000 streams
    .venv/bin/python bench/stream_fanout.py --streams 200 --reply-tokens 64  # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from common import mark, write_json
from procs import CpuMeter, cpu_s, descendants, pin
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from stream_clients import ANSWERED, DELAY_BIN_MS, Job, client_main, expected_chain
from stream_report import FD_ALLOWANCE, capacity_counts, percentile_of, print_table, stream_counts

from services.chat.sse import sse_events
from tandem.config import ApiKey, Tier, parse_cpu_list
from tandem.devstack.bus_users import join_local_bus
from tandem.devstack.members import api_keys_spec
from tandem.devstack.proc import ChildProcess, free_ports
from tandem.devstack.secrets import login_of
from tandem.devstack.stack import Console, Stack, StackConfig
from tandem.tokenlog import logged_events
from tandem.tokenlog.keys import ReplyKeys

API_KEY = "bench-streams"
HOST = "127.0.0.1"
KEYS = {API_KEY: ApiKey(user_id="bencher", tier=Tier.PRO)}
PROMPT = "Write a very long story about a lighthouse keeper and a storm, chapter by chapter, {index}."
DELAY_TARGET_MS = 250.0


class ChatProbe:
    """Samples one chat process's RSS and open file descriptors (/proc) and the bench's count of
    streams held, keeping the peak."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.baseline = self.sample(0)
        self.peak = dict(self.baseline)

    def sample(self, num_held: int) -> dict[str, int]:
        status = Path(f"/proc/{self.pid}/status").read_text()
        rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        return {"held": num_held, "rss_bytes": 1024 * rss_kib, "fds": len(os.listdir(f"/proc/{self.pid}/fd"))}

    async def watch(self, num_held: Any, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = self.sample(num_held.value)
            if now["held"] >= self.peak["held"]:
                self.peak = now
            await asyncio.sleep(0.1)


async def start_reply(http: httpx.AsyncClient, index: int, max_tokens: int, ready: asyncio.Future[str]) -> None:
    """A long reply, read to its end here (its reader keeps it alive); `ready` gets its id."""
    deadline = time.monotonic() + 120
    while True:
        conversation = (await http.post("/v1/conversations", json={})).json()["id"]
        body = {"content": PROMPT.format(index=index), "temperature": 0, "max_tokens": max_tokens}
        async with http.stream("POST", f"/v1/conversations/{conversation}/messages", json=body) as response:
            if response.status_code == 200:
                ready.set_result(response.headers["x-message-id"])
                async for _ in response.aiter_bytes():
                    pass
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"a reply could not start: {response.status_code} {(await response.aread()).decode()}")
        await asyncio.sleep(1.0)  # the chat instance learns the served model from the workers' heartbeats


async def watch_log(redis: Redis, reply_id: str, written_s: dict[int, float], stop: asyncio.Event) -> None:
    """When each of the reply's log entries appears (its seq -> unix time), by blocking XREAD."""
    last_id = "0-0"
    while not stop.is_set():
        response = await redis.xread({ReplyKeys(reply_id).log: last_id}, count=256, block=500)
        now_s = time.time()
        for _, entries in response or []:
            for entry_id, _fields in entries:
                written_s.setdefault(int(entry_id.decode().split("-")[0]), now_s)
                last_id = entry_id


async def expected_events(redis: Redis, reply_id: str, written_s: dict[int, float]) -> tuple[int, list[float]]:
    """The chain of the reply's SSE events from its full log, and when each event id's entry was
    written (index id - 1; 0 for the meta event)."""
    events, written = [], [0.0]
    for token_event in await logged_events(redis, reply_id):
        for sse in sse_events(token_event):
            events.append(sse.encode())
            written.append(written_s.get(token_event.seq, 0.0))
    return expected_chain(events), written


def spread(reply_ids: Sequence[str], num_streams: int, num_clients: int) -> list[list[str]]:
    """Streams dealt round-robin over the replies, then over the client processes."""
    streams = [reply_ids[i % len(reply_ids)] for i in range(num_streams)]
    return [streams[c::num_clients] for c in range(num_clients)]


async def ask(conns: list[Any], jobs: list[Job], while_held: Callable[[], Awaitable[None]] | None = None) -> list[Any]:
    """Each client's summaries of its job. Capacity jobs hold their streams until every client
    has all its answers (a client closing its streams first would free slots for another's);
    `while_held` is awaited then, before they close."""
    for conn, job in zip(conns, jobs):
        conn.send(job)
    if any(job.mode == "capacity" for job in jobs):
        words = await asyncio.gather(*(asyncio.to_thread(conn.recv) for conn in conns))
        assert all(word == ANSWERED for word in words), words
        if while_held is not None:
            await while_held()
        for conn in conns:
            conn.send("close")
    return await asyncio.gather(*(asyncio.to_thread(conn.recv) for conn in conns))


async def read_phase(args: argparse.Namespace, stack: Stack, conns: list[Any], num_held: Any, client_pids: Sequence[int]) -> dict[str, Any]:
    chat = stack.member("chat")
    assert chat.pid is not None and chat.http_port is not None
    redis = Redis.from_url(stack.redis_url)
    async with httpx.AsyncClient(base_url=chat.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=None) as http:
        probe = ChatProbe(chat.pid)
        futures = [asyncio.get_running_loop().create_future() for _ in range(args.replies)]
        replies = [asyncio.create_task(start_reply(http, i, args.reply_tokens, f)) for i, f in enumerate(futures)]
        reply_ids = list(await asyncio.gather(*futures))
        stop = asyncio.Event()
        written: dict[str, dict[int, float]] = {reply_id: {} for reply_id in reply_ids}
        watchers = [asyncio.create_task(watch_log(redis, r, written[r], stop)) for r in reply_ids]
        watcher = asyncio.create_task(probe.watch(num_held, stop))
        jobs = [
            Job(HOST, chat.http_port, API_KEY, part, max_connecting=args.max_connecting)
            for part in spread(reply_ids, args.streams, args.clients)
        ]
        others = CpuMeter(other_processes(stack, client_pids))
        started_s, cpu_before_s = time.time(), cpu_s(probe.pid)
        others.start()
        summaries = [s for part in await ask(conns, jobs) for s in part]
        chat_cpu_s = cpu_s(probe.pid) - cpu_before_s
        streaming_s = time.time() - started_s
        others_cpu_s = others.stop()
        seen = chat_metrics((await http.get(f"{chat.ops_url}/metrics")).text)
        await asyncio.gather(*replies)
        stop.set()
        await asyncio.gather(*watchers, watcher)
        expected = {r: await expected_events(redis, r, written[r]) for r in reply_ids}
        for conn in conns:
            conn.send({r: times for r, (_, times) in expected.items()})
        histograms = await asyncio.gather(*(asyncio.to_thread(conn.recv) for conn in conns))
        after = await settled(probe)
    await redis.aclose()
    wanted = {r: (chain, len(times)) for r, (chain, times) in expected.items()}
    delays = [sum(column) for column in zip(*(delays for delays, _ in histograms))]
    client_lags = [sum(column) for column in zip(*(lags for _, lags in histograms))]
    return stream_counts(summaries, wanted, delays, DELAY_BIN_MS, started_s) | {
        "client_loop_lag_p50_ms": percentile_of(client_lags, DELAY_BIN_MS, 50),
        "client_loop_lag_p99_ms": percentile_of(client_lags, DELAY_BIN_MS, 99),
        "replies": len(reply_ids), "events_per_reply": {r: n for r, (_, n) in wanted.items()},
        "chat_cpu_s": chat_cpu_s, "streaming_s": streaming_s, "others_cpu_s": others_cpu_s, "chat_cpu_us_per_event": 1e6 * chat_cpu_s / max(1, sum(s["num_events"] for s in summaries)),
        "replies_s": max((max(w.values(), default=started_s) for w in written.values()), default=started_s) - started_s,
        "streams_attached_s": sorted(s["attached_s"] - started_s for s in summaries if s["status"] == 200)[:: max(1, len(summaries) // 100)],
        "stream_answer_s": answer_times(summaries),
        "streams_attached_while_running": sum(
            1 for s in summaries if s["status"] == 200 and s["attached_s"] < max(written[s["reply_id"]].values(), default=0.0)
        ),
        "chat_gc": seen.pop("gc"), "chat_metrics": seen,
        "chat_baseline": probe.baseline, "chat_peak": probe.peak, "chat_after": after,
        "rss_bytes_per_stream": (probe.peak["rss_bytes"] - probe.baseline["rss_bytes"]) / max(1, probe.peak["held"]),
    }  # fmt: skip


def answer_times(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """How long the streams answered 200 waited for their answer's head after their request (a
    stream opens once a client has written its request: these are the chat's and the network's)."""
    waits = sorted(s["attached_s"] - s["requested_s"] for s in summaries if s["status"] == 200 and s["requested_s"])
    if not waits:
        return {}
    return {f"p{q}": waits[min(len(waits) - 1, int(q / 100 * len(waits)))] for q in (50, 90, 99)} | {"max": waits[-1]}


def other_processes(stack: Stack, client_pids: Sequence[int]) -> dict[str, list[int]]:
    """The processes beside the chat instance whose CPU time the bench reports, by role: the
    client processes, each worker with its engine process, the relay, and the rest of the stack."""
    groups: dict[str, list[int]] = {"clients": list(client_pids)}
    for member in stack.members:
        if member.pid is not None and member.role != "chat":
            name = member.role if member.role in ("decode", "relay") else "rest of the stack"
            groups.setdefault(name, []).extend([member.pid, *descendants(member.pid)])
    return groups


def chat_metrics(metrics_text: str) -> dict[str, Any]:
    """From the chat's /metrics at the end: its cyclic-collector passes by generation (count,
    total and longest s, objects collected), and the p50/p99 (a bucket's upper edge) of its event
    loop's lag, of its feeds' passes (a reply's new events to all its streams), and of the delay
    from a token's production (the worker's clock) to the end of its pass (the chat's side of the
    delay, without the clients' reads)."""
    passes: dict[str, dict[str, float]] = {}
    buckets: dict[str, list[tuple[float, float]]] = {
        "tandem_event_loop_lag_seconds": [], "tandem_chat_stream_pass_seconds": [], "tandem_chat_stream_write_delay_seconds": [],
    }  # fmt: skip
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = {"tandem_gc_pause_seconds_count": "count", "tandem_gc_pause_seconds_sum": "total_s"}.get(sample.name)
            name = "longest_s" if sample.name == "tandem_gc_pause_longest_seconds" else name
            name = "collected" if sample.name == "python_gc_objects_collected_total" else name
            if name is not None:
                passes.setdefault(sample.labels["generation"], {})[name] = sample.value
            if sample.name.endswith("_bucket") and sample.name[: -len("_bucket")] in buckets:
                buckets[sample.name[: -len("_bucket")]].append((float(sample.labels["le"]), sample.value))
    lag, fanout = buckets["tandem_event_loop_lag_seconds"], buckets["tandem_chat_stream_pass_seconds"]
    written = buckets["tandem_chat_stream_write_delay_seconds"]
    return {
        "gc": passes,
        "loop_lag_p50_ms": bucket_quantile_ms(lag, 0.50), "loop_lag_p99_ms": bucket_quantile_ms(lag, 0.99),
        "pass_p50_ms": bucket_quantile_ms(fanout, 0.50), "pass_p99_ms": bucket_quantile_ms(fanout, 0.99),
        "written_p50_ms": bucket_quantile_ms(written, 0.50), "written_p99_ms": bucket_quantile_ms(written, 0.99),
    }  # fmt: skip


def bucket_quantile_ms(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """The upper edge (ms) of the first bucket holding the q-quantile of a Prometheus histogram's
    cumulative buckets; None when it saw nothing."""
    cumulative = sorted(cumulative)
    total = cumulative[-1][1] if cumulative else 0.0
    if total == 0:
        return None
    return next(1000 * edge for edge, count in cumulative if count >= q * total)


async def settled(probe: ChatProbe, timeout_s: float = 15.0) -> dict[str, int]:
    """The chat process once its streams' descriptors are closed (fds back to the baseline and
    the Redis connections it keeps)."""
    deadline = time.monotonic() + timeout_s
    now = probe.sample(0)
    while now["fds"] > probe.baseline["fds"] + FD_ALLOWANCE and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        now = probe.sample(0)
    return now


async def capacity_phase(args: argparse.Namespace, stack: Stack, conns: list[Any], env: dict[str, str]) -> dict[str, Any]:
    """A second chat instance with TANDEM_MAX_STREAMS=capacity, asked for 2x its capacity in
    streams of replies running on the first."""
    port, ops_port = free_ports(1), free_ports(1)
    child_env = {
        **os.environ, **env, "PYTHONUNBUFFERED": "1", "TANDEM_HOST": HOST, "TANDEM_HTTP_PORT": str(port), "TANDEM_OPS_PORT": str(ops_port),
        **join_local_bus("chat", "chat-capped", stack.nats_url), "TANDEM_REDIS_URL": login_of(stack.redis_url)[0],
        "TANDEM_API_KEYS": api_keys_spec(KEYS), "TANDEM_MAX_STREAMS": str(args.capacity),
    }  # fmt: skip
    capped = ChildProcess("chat-cap", [sys.executable, "-m", "services.chat"], env=child_env, on_line=lambda *_: None)
    capped.start()
    try:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=None) as http:
            try:
                await wait_ready(http, f"http://{HOST}:{ops_port}/readyz")
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; the capped chat's last lines:\n{capped.recent_output(30)}") from None
            http.base_url = httpx.URL(stack.member("chat").url)
            futures = [asyncio.get_running_loop().create_future() for _ in range(args.replies)]
            replies = [asyncio.create_task(start_reply(http, i, args.reply_tokens, f)) for i, f in enumerate(futures)]
            reply_ids = list(await asyncio.gather(*futures))
            jobs = [
                Job(HOST, port, API_KEY, part, mode="capacity", max_connecting=args.max_connecting)
                for part in spread(reply_ids, 2 * args.capacity, args.clients)
            ]
            capped_counts: dict[str, float] = {}

            async def count_capped() -> None:
                capped_counts.update(stream_slot_counts((await http.get(f"http://{HOST}:{ops_port}/metrics")).text))

            summaries = [s for part in await ask(conns, jobs, while_held=count_capped) for s in part]
            replies_running = sum(1 for r in replies if not r.done())
            for reply in replies:
                reply.cancel()
            await asyncio.gather(*replies, return_exceptions=True)
    finally:
        await asyncio.to_thread(capped.stop, 10.0)
    return capacity_counts(summaries) | {
        "capacity": args.capacity, "replies_running_when_answered": replies_running, "capped_chat": capped_counts,
    }  # fmt: skip


def stream_slot_counts(metrics_text: str) -> dict[str, float]:
    """The capped chat's own count of its streams: refused by code, dropped for lag, resumed, open
    (taken while the phase's streams are all answered and none closed by the clients)."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "tandem_chat_streams_refused_total":
                counts[f"refused_{sample.labels['code']}"] = sample.value
            elif sample.name in ("tandem_chat_streams_dropped_total", "tandem_chat_stream_resumes_total", "tandem_chat_streams_open"):
                counts[sample.name.removeprefix("tandem_chat_").removesuffix("_total")] = sample.value
    return counts


async def wait_ready(http: httpx.AsyncClient, url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await http.get(url)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready in {timeout_s:.0f} s")
        await asyncio.sleep(0.25)


def stack_env(args: argparse.Namespace, workdir: Path) -> dict[str, str]:
    env = {
        "TANDEM_STORE": "sqlite", "TANDEM_SQLITE_PATH": str(workdir / "conversations.db"), "TANDEM_LOG_LEVEL": "warning",
        "TANDEM_KV_CACHE_MIB": "256", "TANDEM_MAX_ANSWER_TOKENS": str(max(512, args.reply_tokens)),
        "TANDEM_MAX_STREAMS": str(args.streams + 64), "TANDEM_STREAM_LIMIT_PRO": str(max(20000, 2 * args.streams + 64)),
    }  # fmt: skip
    env.update(dict(item.split("=", 1) for item in args.env))
    return env


def pin_chat_apart(stack: Stack, clients: Sequence[multiprocessing.process.BaseProcess], chat_cpus: frozenset[int]) -> frozenset[int]:
    """The chat instance on `chat_cpus`; everything else (the other services, redis, nats, the
    client processes, this one) on the rest. Returns the rest."""
    rest = frozenset(os.sched_getaffinity(0)) - chat_cpus
    if not chat_cpus or not rest:
        raise SystemExit(f"--chat-cpus must leave other CPUs for the rest; this process may use {sorted(os.sched_getaffinity(0))}")
    for member in stack.members:
        if member.pid is not None:
            pin(member.pid, chat_cpus if member.role == "chat" else rest)
    for client in clients:
        if client.pid is not None:
            pin(client.pid, rest)
    pin(os.getpid(), rest, with_children=False)  # not the stack's members and clients again
    return rest


async def main(args: argparse.Namespace) -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the chat instance inherits it
    context = multiprocessing.get_context("spawn")
    num_held = context.Value("i", 0)
    pipes = [context.Pipe() for _ in range(args.clients)]
    processes = [context.Process(target=client_main, args=(child, num_held), daemon=True) for _, child in pipes]
    for process in processes:
        process.start()
    conns = [parent for parent, _ in pipes]
    workdir = Path(tempfile.mkdtemp(prefix="tandem-streams-"))
    env = stack_env(args, workdir)
    config = StackConfig(
        host=HOST, chat_port=free_ports(1), api_keys=KEYS,
        extra_env=env, num_decode_workers=1, num_prefill_workers=0, num_chat_instances=1,
    )  # fmt: skip
    log_path = Path(args.log) if args.log else workdir / "stack.log"
    with log_path.open("w") as log:
        async with Stack(config, Console(log)) as stack:
            print(f"stack up (log: {log_path}); opening {args.streams} streams over {args.replies} replies", flush=True)
            result = {"streams_requested": args.streams, "clients": args.clients, "reply_tokens": args.reply_tokens}
            if args.chat_cpus:
                rest = pin_chat_apart(stack, processes, parse_cpu_list(args.chat_cpus))
                result |= {"chat_cpus": sorted(parse_cpu_list(args.chat_cpus)), "other_cpus": sorted(rest)}
            result |= await read_phase(args, stack, conns, num_held, [p.pid for p in processes if p.pid is not None])
            if args.capacity:
                print(f"capacity phase: {2 * args.capacity} streams at TANDEM_MAX_STREAMS={args.capacity}", flush=True)
                result["capacity_phase"] = await capacity_phase(args, stack, conns, env)
    for conn in conns:
        conn.close()
    for process in processes:
        process.join(timeout=10)
    print_table(result, DELAY_TARGET_MS, mark)
    write_json(Path(args.out) if args.out else None, result)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=10_000, help="streams on the chat instance under test")
    parser.add_argument("--replies", type=int, default=4, help="long replies the streams are spread over")
    parser.add_argument("--reply-tokens", type=int, default=400, help="each reply's max_tokens (greedy)")
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--capacity", type=int, help="TANDEM_MAX_STREAMS of the 2x phase (default: --streams; 0 skips it)")
    parser.add_argument("--max-connecting", type=int, default=128, help="connections awaiting their answer, per process")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=(
            "smoke sizes: 200 streams, 2 replies of 512 tokens (they outlast the opening of the streams, so some events are timed"
            " live: 128 did not on a Zen 5 host with the cores busy), 2 clients, capacity 50"
        ),
    )
    parser.add_argument(
        "--chat-cpus",
        default="",
        help="the chat instance alone on these CPUs (0, 0-1, 0,2), everything else (workers, redis, nats, the clients) on the rest",
    )
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every service (repeatable)")
    parser.add_argument("--out", default="", help="write the numbers as JSON here")
    parser.add_argument("--log", default="", help="write the stack's log (every process's output) here")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.replies, args.reply_tokens, args.clients, args.max_connecting = 200, 2, 512, 2, 32
        args.capacity = 50 if args.capacity is None else args.capacity
    if args.capacity is None:
        args.capacity = args.streams
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
