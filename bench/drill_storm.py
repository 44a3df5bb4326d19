"""The reconnect storm drill (issue 54): N SSE streams (--storm-streams, default 2,000) over a few
long replies, held on one chat instance; kill -9 that instance (held down for the drill); every
client reconnects at once to the other with its Last-Event-ID, as browsers behind a load
balancer do, and reads on to the reply's end.

Reported: the streams; how many resumed on the other instance and read on; how many read every
event (their bytes equal to the reply's log from Redis, ids contiguous across the reconnect); the
answers with a 5xx (a refused one is asked again after its Retry-After, as a browser does); gaps
(streams whose ids or events differ from the log); the longest pause a stream saw between two
events once its reply's answer began; and how long after the kill the last reconnect was sent.
For this drill `completed`, `errors` and `hung` count streams.

The streams are raw-socket connections (bench/stream_clients.SseStream) on this process's loop:
cheap enough that the clients are not what the drill measures. The replies are started, and their
own streams read, on the instance that survives."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from drill_report import DrillReport
from drill_stack import DrillStack
from redis.asyncio import Redis
from stream_clients import Job, SseStream, StreamResult, expected_chain

from services.chat.sse import sse_events
from tandem.config import ApiKey, Tier
from tandem.tokenlog import load_reply, logged_events

STORM_KEY = "drill-storm-key"
STORM_KEYS = {STORM_KEY: ApiKey(user_id="stormer", tier=Tier.PRO)}  # pro: 20,000 streams an instance
PROMPT = "Write a very long story about a lighthouse keeper and a storm, chapter by chapter ({index})."
MAX_CONNECTING = 128  # streams opened and not yet answered, at once, before the fault
MAX_RETRIES = 20  # refused answers (5xx) or failed connects a stream asks again after
STORM_TIMEOUT_S = 600.0


@dataclass
class Storming:
    """One stream: its reader's result (ids, chain, arrivals), its answers with a 5xx, and when it reconnected."""

    result: StreamResult
    num_5xx: int = 0
    num_tries: int = 0
    reconnected_s: float = 0.0  # unix time of its reconnect after the fault; 0: none
    is_resumed: bool = False  # answered 200 on the other instance after the fault
    is_ended: bool = False


class Storm:
    """Every stream, opened on the `victim` instance (its host and port); after `cut()` every
    reconnect goes to the `other` (on a host of its own under --hosts, often on the same port)."""

    def __init__(self, victim: tuple[str, int], other: tuple[str, int], reply_ids: list[str], num_streams: int) -> None:
        self._jobs = {address: Job(address[0], address[1], STORM_KEY, []) for address in (victim, other)}
        self._address, self._other_address = victim, other
        self.streams = [Storming(StreamResult(reply_ids[i % len(reply_ids)])) for i in range(num_streams)]
        self._connecting = asyncio.Semaphore(MAX_CONNECTING)
        self._num_ended = 0
        self.all_ended = asyncio.Event()
        self.cut_s = 0.0  # unix time of the fault
        self._tasks: set[asyncio.Task[None]] = set()

    async def open_all(self) -> None:
        for stream in self.streams:
            await self._connecting.acquire()
            self._spawn(self._open(stream, last_event_id=0, answered=self._connecting.release))

    def cut(self) -> None:
        """The fault is now: from here on every stream reconnects to the other instance."""
        self.cut_s = time.time()
        self._address = self._other_address

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, stream: Storming, last_event_id: int, answered: Callable[[], None] | None = None) -> None:
        """A request for the stream after `last_event_id` to the instance streams go to now; one
        that is cut before its end, refused, or cannot connect is asked again (after a refusal's
        Retry-After)."""
        loop = asyncio.get_running_loop()
        address = self._address
        was_answered = False

        def on_answer() -> None:
            nonlocal was_answered
            if was_answered:
                return
            was_answered = True
            if answered is not None:
                answered()
            if reader.status >= 500:
                stream.num_5xx += 1
            elif reader.status == 200 and self.cut_s and address == self._other_address:
                stream.is_resumed = True

        def on_end(ended: SseStream) -> None:
            if not was_answered and answered is not None:
                answered()
            if not stream.result.is_done and stream.num_tries < MAX_RETRIES:
                refused = ended.status not in (0, 200)
                stream.num_tries += int(refused)
                self._spawn(self._reopen(stream, delay_s=2.0 if refused else 0.0))
                return
            self._end(stream)

        job = self._jobs[address]
        reader = SseStream(job, stream.result, last_event_id, on_answer, on_end)
        if self.cut_s and not stream.reconnected_s:
            stream.reconnected_s = time.time()
        try:
            await loop.create_connection(lambda: reader, job.host, job.port)
        except OSError:
            if answered is not None:
                answered()
            stream.num_tries += 1
            if stream.num_tries < MAX_RETRIES:
                self._spawn(self._reopen(stream, delay_s=0.2))
            else:
                self._end(stream)
            return

    async def _reopen(self, stream: Storming, delay_s: float) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
        await self._open(stream, last_event_id=stream.result.num_events)

    def _end(self, stream: Storming) -> None:
        if not stream.is_ended:
            stream.is_ended = True
            self._num_ended += 1
            if self._num_ended == len(self.streams):
                self.all_ended.set()

    async def wait_streaming(self, timeout_s: float) -> int:
        """Until every stream has its meta and a first event of its reply (the backlog counts);
        returns how many have."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            num = sum(s.result.num_events >= 2 for s in self.streams)
            if num == len(self.streams):
                return num
            await asyncio.sleep(0.2)
        return sum(s.result.num_events >= 2 for s in self.streams)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


async def start_replies(url: str, num_replies: int, max_tokens: int) -> tuple[list[str], list[asyncio.Task[None]]]:
    """Long greedy replies started on `url`, each one's own stream read to its end in a task."""
    http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {STORM_KEY}"}, timeout=httpx.Timeout(STORM_TIMEOUT_S))
    started: list[asyncio.Future[str]] = [asyncio.get_running_loop().create_future() for _ in range(num_replies)]

    async def one(index: int) -> None:
        conversation = (await http.post("/v1/conversations", json={})).json()["id"]
        body = {"content": PROMPT.format(index=index), "temperature": 0, "max_tokens": max_tokens}
        async with http.stream("POST", f"/v1/conversations/{conversation}/messages", json=body) as response:
            if response.status_code != 200:
                started[index].set_exception(RuntimeError(f"reply {index}: {response.status_code} {(await response.aread())[:200]!r}"))
                return
            async for line in response.aiter_lines():
                if line.startswith("event: delta") and not started[index].done():
                    started[index].set_result(response.headers["x-message-id"])
        if not started[index].done():
            started[index].set_exception(RuntimeError(f"reply {index} ended before its first token"))

    async def all_of_them() -> None:
        try:
            await asyncio.gather(*(one(i) for i in range(num_replies)))
        finally:
            await http.aclose()

    reading = asyncio.ensure_future(all_of_them())
    reply_ids = [await asyncio.wait_for(future, timeout=180) for future in started]
    return reply_ids, [reading]


async def expected_chains(redis: Redis, reply_ids: list[str]) -> dict[str, tuple[int, int]]:
    """Each reply's chain over its log's SSE events (ids >= 2) and its last event id."""
    chains = {}
    for reply_id in reply_ids:
        events = [sse for event in await logged_events(redis, reply_id) for sse in sse_events(event)]
        chains[reply_id] = (expected_chain([sse.encode() for sse in events]), events[-1].id if events else 0)
    return chains


def longest_pause_s(result: StreamResult) -> float:
    """The longest wait between two events the stream received after its reply's first (the
    backlog arrives at once)."""
    arrivals = result.arrivals_s[1:]
    return max((b - a for a, b in zip(arrivals, arrivals[1:], strict=False)), default=0.0)


async def reconnect_storm(stack: DrillStack, args: argparse.Namespace) -> DrillReport:
    n, target = args.storm_streams, storm_target(args)
    report = DrillReport(name="reconnect_storm", fault="none", num_replies=n, target=target)
    started_s = time.monotonic()
    victim = stack.members("chat")[0]
    victim_url, other_url = stack.chat_urls[0], stack.chat_urls[1]
    reply_ids, own_streams = await start_replies(other_url, args.storm_replies, args.storm_tokens)
    storm = Storm(address_of(victim_url), address_of(other_url), reply_ids, n)
    redis = Redis.from_url(stack.stack.redis_url)
    try:
        await storm.open_all()
        num_streaming = await storm.wait_streaming(timeout_s=180)
        running = [meta for meta in [await load_reply(redis, r, with_request=False) for r in reply_ids] if meta and meta.is_running]
        storm.cut()
        report.fault_unix_s = round(storm.cut_s, 3)
        pid = stack.stack.member(victim).pid
        await stack.stack.hold(victim, signal.SIGKILL)
        report.fault = f"kill -9 {victim} (pid {pid}) holding {num_streaming} streams of {len(reply_ids)} replies ({len(running)} running)"
        await asyncio.wait_for(storm.all_ended.wait(), timeout=STORM_TIMEOUT_S)
        await asyncio.gather(*own_streams, return_exceptions=True)
        chains = await expected_chains(redis, reply_ids)
    finally:
        storm.close()
        await redis.aclose()
        await stack.stack.release(victim, timeout_s=120)
    fill(report, storm, chains)
    report.seconds = round(time.monotonic() - started_s, 1)
    return report


def fill(report: DrillReport, storm: Storm, chains: dict[str, tuple[int, int]]) -> None:
    streams = storm.streams
    report.streams = len(streams)
    report.replies = len(chains)
    report.resumed = sum(s.is_resumed for s in streams)
    report.num_5xx = sum(s.num_5xx for s in streams)
    whole = [s for s in streams if (s.result.chain, s.result.num_events) == chains[s.result.reply_id] and s.result.is_contiguous]
    report.completed = len(whole)
    report.gaps = sum(s.result.is_done and s not in whole for s in streams)
    report.hung = sum(not s.result.is_done for s in streams)
    report.ids_contiguous = all(s.result.is_contiguous for s in streams)
    pauses = [(longest_pause_s(s.result), s) for s in streams]
    longest, stream = max(pauses, key=lambda pair: pair[0], default=(0.0, None))
    report.longest_pause_s = round(longest, 2)
    if stream is not None:
        report.longest_pause_ended_unix_s = round(pause_end_s(stream.result, longest), 3)
    report.pause_across_fault_s = round(max((pause_across(s.result, storm.cut_s) for s in streams), default=0.0), 2)
    reconnects = [s.reconnected_s for s in streams if s.reconnected_s]
    report.reconnected_within_s = round(max(reconnects) - storm.cut_s, 3) if reconnects else None
    codes = sorted({s.result.error_code for s in streams if s.result.error_code})
    report.error_samples = codes[:5]


def pause_end_s(result: StreamResult, pause_s: float) -> float:
    """When the stream's pause of `pause_s` ended (unix time)."""
    arrivals = result.arrivals_s[1:]
    return next((b for a, b in zip(arrivals, arrivals[1:], strict=False) if b - a == pause_s), 0.0)


def pause_across(result: StreamResult, cut_s: float) -> float:
    """From the stream's last event before the fault to its first after it (0: it had ended before)."""
    before = [t for t in result.arrivals_s if t <= cut_s]
    after = [t for t in result.arrivals_s if t > cut_s]
    return after[0] - before[-1] if before and after else 0.0


def address_of(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def storm_target(args: argparse.Namespace) -> str:
    n = args.storm_streams
    return f"{n}/{n} streams resume on the other instance with every event, ids contiguous, 0 5xx"


def storm_met(report: DrillReport) -> bool:
    n = report.streams or 0
    return n > 0 and report.completed == n and report.resumed == n and report.num_5xx == 0 and report.gaps == 0
