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
  kill_prefill   kill -9 the prefill worker with long prompts (remote prefill) in flight
  kill_relay     kill -9 the relay during N streams
  restart_redis  stop redis-server (SIGTERM) and start it again during N streams
  pause_nats     SIGSTOP nats-server for 10 s during N streams, then SIGCONT
  rolling        SIGTERM every service in turn (each restarted by the launcher) under a steady load
  resume         random client disconnects and resumes (Last-Event-ID), alternating chat instances

Targets are printed beside the numbers as information (PASS/MISS), never as an exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from drill_stack import DrillStack

HANG_S = 60.0
TOPICS = (
    "how a bicycle stays upright",
    "why the sky is blue",
    "how vaccines train the immune system",
    "the water cycle",
    "how jet engines work",
    "photosynthesis in desert plants",
    "how GPS satellites keep time",
    "the rules of cricket",
    "composting in a small apartment",
    "learning a second language as an adult",
    "the history of the printing press",
    "sourdough baking at high altitude",
    "caring for a young cat",
    "writing a good cover letter",
    "the causes of the 2008 financial crisis",
    "how tides work",
)


def prompt_of(index: int, long: bool = False) -> str:
    topic = TOPICS[index % len(TOPICS)]
    text = f"Explain {topic} in a few short paragraphs. (request {index})"
    if long:  # long enough to be prefilled remotely (> TANDEM_REMOTE_PREFILL_MIN_TOKENS)
        background = " ".join(f"Note {k}: {TOPICS[(index + k) % len(TOPICS)]} is a topic people ask about." for k in range(18))
        text = f"{background}\n\n{text}"
    return text


# -- one client stream ---------------------------------------------------------------------------


@dataclass
class StreamResult:
    index: int
    outcome: str = "hung"  # complete | error | hung | refused
    text: str = ""
    error: str = ""
    num_events: int = 0
    longest_pause_s: float = 0.0
    longest_pause_ended_unix_s: float = 0.0  # when the longest pause ended (wall clock), to find it in the logs
    ttft_s: float = 0.0  # from sending the message to its first token
    ids_contiguous: bool = True
    num_resumes: int = 0
    message_id: str = ""
    conversation_id: str = ""


@dataclass
class Client:
    urls: list[str]  # chat instances; resumes alternate between them
    key: str
    max_tokens: int
    hang_s: float = HANG_S

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    async def run(
        self,
        http: httpx.AsyncClient,
        index: int,
        prompt: str,
        started: asyncio.Event | None = None,
        disconnects: int = 0,
        rng: random.Random | None = None,
    ) -> StreamResult:
        """Sends `prompt` in a new conversation (greedy) and reads the reply to its end; with
        `disconnects`, drops the connection that many times at random points and resumes with
        Last-Event-ID on the next chat instance. As a browser behind a load balancer would, it
        sends a request that could not connect to the next chat instance, and resumes a stream
        that broke on the next one too."""
        result = StreamResult(index)
        deadline = time.monotonic() + self.hang_s
        try:
            created, instance = await self._send(http, deadline, 0, lambda url: http.build_request(
                "POST", f"{url}/v1/conversations", json={}, headers=self.headers))  # fmt: skip
            try:
                await created.aread()
                created.raise_for_status()
                result.conversation_id = created.json()["id"]
            finally:
                await created.aclose()
            body = {"content": prompt, "temperature": 0, "max_tokens": self.max_tokens}

            def post_message(url: str) -> httpx.Request:
                return http.build_request(
                    "POST", f"{url}/v1/conversations/{result.conversation_id}/messages", json=body, headers=self.headers
                )

            def resume(url: str) -> httpx.Request:
                headers = {**self.headers, "Last-Event-ID": str(last_id)}
                return http.build_request("GET", f"{url}/v1/messages/{result.message_id}/stream", headers=headers)

            build = post_message
            sent_s = time.monotonic()
            last_id = 0
            last_event_s = time.monotonic()
            drops_left = disconnects
            while True:
                response, instance = await self._send(http, deadline, instance, build)
                try:
                    if response.status_code != 200:
                        result.outcome = "refused"
                        result.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
                        return result
                    drop_after = rng.randint(1, 6) if drops_left > 0 and rng is not None else None
                    seen_here = 0
                    async for sse in sse_events(response, deadline):
                        now_s = time.monotonic()
                        # A pause is a gap after the answer began (the wait for the first token is TTFT, not a pause).
                        if result.text and now_s - last_event_s > result.longest_pause_s:
                            result.longest_pause_s = now_s - last_event_s
                            result.longest_pause_ended_unix_s = round(time.time(), 3)
                        last_event_s = now_s
                        result.num_events += 1
                        if sse.id:
                            if last_id and sse.id != last_id + 1:
                                result.ids_contiguous = False
                            last_id = sse.id
                        if sse.event == "meta":
                            result.message_id = sse.data.get("message_id", result.message_id)
                        elif sse.event == "delta":
                            if not result.text:
                                result.ttft_s = round(now_s - sent_s, 3)
                            result.text += sse.data.get("text", "")
                        elif sse.event == "done":
                            result.outcome = "complete"
                            return result
                        elif sse.event == "error":
                            result.outcome = "error"
                            result.error = str(sse.data.get("message", sse.data))[:300]
                            return result
                        if started is not None and sse.event == "delta":
                            started.set()
                        seen_here += 1
                        if drop_after is not None and seen_here >= drop_after:
                            drops_left -= 1
                            break
                except httpx.TransportError:  # the instance went away mid-stream: resumed below
                    if not result.message_id:
                        raise
                finally:
                    await response.aclose()
                if time.monotonic() >= deadline:
                    return result  # hung
                # The connection ended before the final event (dropped here, or broken): resume.
                if not result.message_id:
                    result.error = "the stream ended before its meta event"
                    return result
                result.num_resumes += 1
                instance = (instance + 1) % len(self.urls)
                build = resume
        except (httpx.HTTPError, OSError) as exc:
            result.outcome = "hung" if time.monotonic() >= deadline else "error"
            result.error = f"{type(exc).__name__}: {exc}"[:300]
            return result

    async def _send(
        self, http: httpx.AsyncClient, deadline: float, instance: int, build: Callable[[str], httpx.Request]
    ) -> tuple[httpx.Response, int]:
        """`build(url)` sent to chat instance `instance`, streamed; a refused connection (the
        request never arrived) goes to the next instance, and after a round of refusals waits a
        moment (a backoff, up to 1 s) before the next round, until `deadline`."""
        delay_s = 0.1
        for tried in itertools.count(1):
            try:
                return await http.send(build(self.urls[instance]), stream=True), instance
            except httpx.ConnectError:
                if time.monotonic() + delay_s >= deadline:
                    raise
                instance = (instance + 1) % len(self.urls)
                if tried % len(self.urls) == 0:
                    await asyncio.sleep(delay_s)
                    delay_s = min(1.0, delay_s * 2)
        raise AssertionError("unreachable")


@dataclass
class _Sse:
    id: int
    event: str
    data: dict[str, Any]


async def sse_events(response: httpx.Response, deadline: float):  # type: ignore[no-untyped-def]
    fields: dict[str, str] = {}
    lines = response.aiter_lines()
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            return
        try:
            line = await asyncio.wait_for(anext(lines), timeout=left_s)
        except (StopAsyncIteration, TimeoutError):
            return
        if line == "":
            if "data" in fields:
                try:
                    data = json.loads(fields["data"])
                except json.JSONDecodeError:
                    data = {"raw": fields["data"]}
                yield _Sse(int(fields.get("id", "0") or 0), fields.get("event", "message"), data)
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = fields.get(name, "") + value.removeprefix(" ")


# -- drills -----------------------------------------------------------------------------------------


@dataclass
class DrillReport:
    name: str
    fault: str
    num_replies: int
    fault_unix_s: float = 0.0  # when the fault was caused (wall clock)
    longest_pause_ended_unix_s: float = 0.0
    longest_ttft_s: float = 0.0  # a reply lost before its first token waits here, not in a pause
    completed: int = 0
    errors: int = 0
    hung: int = 0
    refused: int = 0
    longest_pause_s: float = 0.0
    # the longest pause in the undisturbed run of the same prompts (same stack, same run): what
    # the load alone costs on this machine; None when the drill had no undisturbed run
    undisturbed_longest_pause_s: float | None = None
    texts_identical: int | None = None  # of the completed greedy replies, how many match the undisturbed run
    texts_differing: list[int] = field(default_factory=list)  # prompt indices of completed replies that do not
    texts_without_baseline: list[int] = field(default_factory=list)  # completed here, not in the undisturbed run
    ids_contiguous: bool = True
    stored: dict[str, int] = field(default_factory=dict)  # stored assistant turn statuses
    target: str = ""
    met: bool = False
    seconds: float = 0.0
    error_samples: list[str] = field(default_factory=list)


Fault = Callable[[DrillStack], Awaitable[str]]


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


# -- faults ---------------------------------------------------------------------------------------


async def kill_decode(stack: DrillStack) -> str:
    name = stack.busiest("decode")
    pid = stack.signal(name, signal.SIGKILL)
    return f"kill -9 {name} (pid {pid})"


async def kill_prefill(stack: DrillStack) -> str:
    name = stack.members("prefill")[0]
    pid = stack.signal(name, signal.SIGKILL)
    return f"kill -9 {name} (pid {pid})"


async def kill_relay(stack: DrillStack) -> str:
    name = stack.members("relay")[0]
    pid = stack.signal(name, signal.SIGKILL)
    return f"kill -9 {name} (pid {pid})"


async def restart_redis(stack: DrillStack) -> str:
    old_pid = stack.stack.member("redis").pid
    await stack.stack.restart("redis", signal.SIGTERM, timeout_s=60.0)
    return f"SIGTERM redis-server (pid {old_pid}), started again on the same port (pid {stack.stack.member('redis').pid})"


async def pause_nats(stack: DrillStack) -> str:
    pid = stack.signal("nats", signal.SIGSTOP)
    await asyncio.sleep(10.0)  # the fault itself lasts 10 s
    stack.signal("nats", signal.SIGCONT)
    return f"SIGSTOP nats-server (pid {pid}) for 10 s"


async def rolling(stack: DrillStack) -> str:
    done = []
    for name in stack.service_members():
        pid = stack.signal(name, signal.SIGTERM)
        await stack.wait_restarted(name, pid, timeout_s=180.0)
        done.append(name)
    return "SIGTERM in turn: " + ", ".join(done)


# -- main -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrillPlan:
    name: str
    fault: Fault | None
    num_streams: int
    target: str
    long_prompts: bool = False
    disconnects: int = 0
    check_texts: bool = True
    steady: bool = False  # the load lasts as long as the fault: each reply is sent again once it ends


def plans(args: argparse.Namespace) -> dict[str, DrillPlan]:
    n = args.streams
    return {
        "kill_decode": DrillPlan("kill_decode", kill_decode, n, f"{n}/{n} complete, texts identical, longest pause <= 3 s"),
        "kill_prefill": DrillPlan(
            "kill_prefill", kill_prefill, max(1, n // 2), f"{max(1, n // 2)}/{max(1, n // 2)} complete", long_prompts=True
        ),
        "kill_relay": DrillPlan("kill_relay", kill_relay, n, f"{n}/{n} complete, every stored turn complete"),
        "restart_redis": DrillPlan("restart_redis", restart_redis, n, f"{n}/{n} complete, every stored turn complete"),
        "pause_nats": DrillPlan("pause_nats", pause_nats, n, "every reply completes or errors clearly; 0 hung", check_texts=False),
        "rolling": DrillPlan("rolling", rolling, max(1, n // 2), "0 replies lost (0 hung, 0 errors)", steady=True),
        "resume": DrillPlan(
            "resume", None, args.resume_streams, "every text identical, event ids contiguous", disconnects=args.resume_drops
        ),
    }


def met(report: DrillReport, plan: DrillPlan) -> bool:
    n = report.num_replies
    identical = report.texts_identical == n if report.texts_identical is not None else True
    if plan.name == "kill_decode":
        return report.completed == n and identical and report.longest_pause_s <= 3.0
    if plan.name in ("kill_relay", "restart_redis"):
        return report.completed == n and report.stored.get("complete", 0) == n
    if plan.name == "pause_nats":
        return report.hung == 0
    if plan.name == "resume":
        return report.completed == n and identical and report.ids_contiguous
    return report.completed == n


async def main(args: argparse.Namespace) -> int:
    chosen = [d for d in args.drills.split(",") if d]
    every = plans(args)
    unknown = [d for d in chosen if d not in every]
    if unknown:
        print(f"unknown drill(s) {', '.join(unknown)}; choose from {', '.join(every)}", file=sys.stderr)
        return 2
    stack = DrillStack(decode_workers=2, prefill_workers=1, chat_instances=2, extra_env=_stack_env(args))
    reports: list[DrillReport] = []
    async with stack:
        client = Client(urls=stack.chat_urls, key=stack.api_key, max_tokens=args.max_tokens, hang_s=args.hang_s)
        baselines: dict[bool, dict[int, str]] = {}
        baseline_pauses: dict[bool, float] = {}
        for name in chosen:
            plan = every[name]
            await stack.wait_all_ready(timeout_s=300.0)
            prompts = [prompt_of(i, plan.long_prompts) for i in range(plan.num_streams)]
            if plan.check_texts and plan.long_prompts not in baselines:
                count = max(p.num_streams for p in every.values() if p.long_prompts == plan.long_prompts and p.name in chosen)
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
            _print_row(report)
        if args.log:
            Path(args.log).write_text(stack.logs(num_lines=1_000_000) + "\n")
    _print_table(reports)
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in reports], indent=2) + "\n")
    return 0


def _stack_env(args: argparse.Namespace) -> dict[str, str]:
    # The drill key is plus: its stream limit must not refuse the resume drill's 40 at once.
    env = {"TANDEM_KV_CACHE_MIB": "256", "TANDEM_LOG_LEVEL": "warning", "TANDEM_STREAM_LIMIT_PLUS": "1000"}
    env.update(dict(item.split("=", 1) for item in args.env))
    return env


def _print_row(report: DrillReport) -> None:
    print(
        f"{report.name}: {report.completed}/{report.num_replies} complete, {report.errors} errors, {report.hung} hung, {report.refused} refused, "
        f"pause {report.longest_pause_s} s, TTFT max {report.longest_ttft_s} s, identical {report.texts_identical} "
        f"(differing {report.texts_differing}, no baseline {report.texts_without_baseline}), stored {report.stored} "
        f"[{'PASS' if report.met else 'MISS'}: {report.target}]",
        flush=True,
    )


def _print_table(reports: list[DrillReport]) -> None:
    header = f"{'drill':<14}{'replies':>8}{'done':>6}{'error':>6}{'hung':>6}{'pause s':>9}{'base s':>8}{'same':>6}  stored / target"
    print("\n" + header)
    for r in reports:
        same = "-" if r.texts_identical is None else str(r.texts_identical)
        base = "-" if r.undisturbed_longest_pause_s is None else str(r.undisturbed_longest_pause_s)
        stored = ",".join(f"{k}:{v}" for k, v in sorted(r.stored.items()))
        print(
            f"{r.name:<14}{r.num_replies:>8}{r.completed:>6}{r.errors:>6}{r.hung:>6}{r.longest_pause_s:>9}{base:>8}{same:>6}  "
            f"{stored} / {'PASS' if r.met else 'MISS'} {r.target}"
        )
        print(f"{'':<14}fault: {r.fault}")
        if r.error_samples:
            print(f"{'':<14}errors: {'; '.join(r.error_samples)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drills", default="kill_decode,kill_prefill,kill_relay,restart_redis,pause_nats,rolling,resume")
    parser.add_argument("--streams", type=int, default=16, help="replies streaming during a drill (prefill and rolling use half)")
    parser.add_argument("--max-tokens", type=int, default=64, help="each greedy answer's length")
    parser.add_argument("--resume-streams", type=int, default=40, help="replies of the resume drill")
    parser.add_argument("--resume-drops", type=int, default=5, help="disconnects per reply in the resume drill")
    parser.add_argument("--hang-s", type=float, default=HANG_S, help="a reply with no final event by then is hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every service (repeatable)")
    parser.add_argument("--out", default="", help="write the reports as JSON here")
    parser.add_argument("--log", default="", help="copy the stack's log (every process's output) here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(asyncio.run(main(parse_args())))
