"""The token path alone: publisher -> JetStream -> the relay's consumer -> the Redis token log, on a
real nats-server and redis-server (started as the tests start them), no model and no other
service. Two ways side by side on the same servers and the same relay process:

- `single`: today's worker before batches: every reply's event of a step published on its own
  subject (`tandem.v1.tokens.<reply_id>`), all of a step's publishes in flight together, each
  awaiting its acknowledgement; the relay appends and acknowledges each event on its own;
- `batched`: one TokenBatch per step for all replies (`tandem.v1.tokens.batch.<worker_id>`),
  appended with one pipelined Redis call and acknowledged once.

The relay (services/relay/consumer.py and appender.py, under uvloop as the service runs) is a
process of its own, so its CPU time (/proc/<pid>/stat) over each phase gives tokens per second
per relay core, the figure the fleet sizes relays by. Wall-clock tokens/s is printed beside it;
on a machine with fewer cores than processes here it is the publisher's and the servers' too.

    python bench/token_path.py [--replies 64] [--tokens 200] [--quick] [--out token_path.json]

bench/common.py (and torch with it) is imported by the measuring process only, never the relay's."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import nats
from redis.asyncio import Redis

from tandem.bus.token_batches import BatchNumbers, batches, publish_batch
from tandem.bus.token_stream import ensure_token_stream, publish_token
from tandem.devstack.servers import start_nats, start_redis
from tandem.tokenlog import ReplyKeys
from tandem.v1.common_pb2 import FINISH_REASON_STOP, Usage
from tandem.v1.tokens_pb2 import TokenEvent

TARGET_RATIO = 5.0  # batched tokens per relay CPU second over single's
WORKER = "decode-bench"
READY = "relay ready"
DONE_TIMEOUT_S = 300.0


async def relay_main(nats_url: str, redis_url: str) -> None:
    """The relay's consumer and appender, no output check, in this process until killed."""
    from services.relay.appender import LogAppender
    from services.relay.consumer import TokenConsumer, TokenConsumerConfig
    from tandem.runtime.runtime import short_command_client
    from tandem.tokenlog import TokenLogWriter

    client = await nats.connect(nats_url)
    redis = short_command_client(redis_url, 64, {})  # as the relay's runtime makes it
    appender = LogAppender(TokenLogWriter(redis, ttl_s=600, running_ttl_s=600), None, lambda event: None)
    consumer = TokenConsumer(client, appender.append, TokenConsumerConfig())
    task = asyncio.create_task(consumer.run())
    deadline_s = time.monotonic() + 30
    while not consumer.is_running:
        if time.monotonic() > deadline_s:
            raise SystemExit("the relay's consumer did not start in 30 s")
        await asyncio.sleep(0.05)
    print(READY, flush=True)
    await task


def step_events(reply_ids: list[str], seq: int, num_tokens: int) -> list[TokenEvent]:
    """One engine step: every reply's next token; the last step ends every reply."""
    events = []
    for reply_id in reply_ids:
        event = TokenEvent(reply_id=reply_id, seq=seq, token_id=1000 + seq, text=" word", worker_id=WORKER, produced_unix_ms=1)
        if seq == num_tokens:
            event.finish = FINISH_REASON_STOP
            event.usage.CopyFrom(Usage(output_tokens=num_tokens))
        events.append(event)
    return events


async def publish_single(js: Any, reply_ids: list[str], num_tokens: int) -> None:
    for seq in range(1, num_tokens + 1):
        await asyncio.gather(*(publish_token(js, event) for event in step_events(reply_ids, seq, num_tokens)))


async def publish_batched(js: Any, reply_ids: list[str], num_tokens: int) -> None:
    numbers = BatchNumbers(WORKER)
    for seq in range(1, num_tokens + 1):
        for batch in batches(WORKER, step_events(reply_ids, seq, num_tokens)):
            await publish_batch(js, batch, numbers.next_id())


async def all_logged(redis: Redis, reply_ids: list[str], num_tokens: int) -> None:
    """Until every reply's log holds its last event (polled: the relay announces nothing)."""
    deadline_s = time.monotonic() + DONE_TIMEOUT_S
    while True:
        pipe = redis.pipeline(transaction=False)
        for reply_id in reply_ids:
            pipe.hget(ReplyKeys(reply_id).meta, "last_seq")
        if all(int(value or 0) == num_tokens for value in await pipe.execute()):
            return
        if time.monotonic() > deadline_s:
            raise SystemExit(f"not every reply logged within {DONE_TIMEOUT_S} s")
        await asyncio.sleep(0.02)


async def run_phase(mode: str, js: Any, redis: Redis, relay_pid: int, num_replies: int, num_tokens: int) -> dict[str, Any]:
    from procs import cpu_s

    reply_ids = [f"bench-{mode}-{uuid.uuid4().hex[:10]}-{i}" for i in range(num_replies)]
    publish = publish_single if mode == "single" else publish_batched
    cpu_before_s, started_s = cpu_s(relay_pid), time.perf_counter()
    await publish(js, reply_ids, num_tokens)
    await all_logged(redis, reply_ids, num_tokens)
    wall_s, relay_cpu_s = time.perf_counter() - started_s, cpu_s(relay_pid) - cpu_before_s
    num_events = num_replies * num_tokens
    return {
        "mode": mode,
        "events": num_events,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(num_events / wall_s, 1),
        "relay_cpu_s": round(relay_cpu_s, 3),
        "tokens_per_relay_cpu_s": round(num_events / max(relay_cpu_s, 0.01), 1),  # a clock tick at least
    }


async def start_relay(nats_url: str, redis_url: str) -> asyncio.subprocess.Process:
    relay = await asyncio.create_subprocess_exec(sys.executable, __file__, "--relay", nats_url, redis_url, stdout=asyncio.subprocess.PIPE)
    assert relay.stdout is not None
    line = await asyncio.wait_for(relay.stdout.readline(), 60)
    if line.decode().strip() != READY:
        relay.kill()
        raise SystemExit(f"the relay did not start: {line!r}")
    return relay


async def bench(num_replies: int, num_tokens: int, workdir: Path) -> dict[str, Any]:
    from common import cpu_host

    bus, redis_server = start_nats(workdir / "nats"), start_redis(workdir / "redis")
    relay = None
    try:
        client = await nats.connect(bus.url)
        redis = Redis.from_url(redis_server.url)
        js = await ensure_token_stream(client)
        relay = await start_relay(bus.url, redis_server.url)
        warm_tokens = max(2, num_tokens // 10)
        for mode in ("single", "batched"):  # each path once before it is measured
            await run_phase(mode, js, redis, relay.pid, num_replies, warm_tokens)
        phases = [await run_phase(mode, js, redis, relay.pid, num_replies, num_tokens) for mode in ("single", "batched")]
        await redis.aclose()
        await client.close()
    finally:
        if relay is not None:
            relay.kill()
            await relay.wait()
        bus.stop()
        redis_server.stop()
    single, batched = phases
    ratio = batched["tokens_per_relay_cpu_s"] / single["tokens_per_relay_cpu_s"]
    return {
        "replies": num_replies,
        "tokens_per_reply": num_tokens,
        "phases": phases,
        "per_core_ratio": round(ratio, 2),
        "target_ratio": TARGET_RATIO,
        "cpu": cpu_host(),
    }


def print_table(report: dict[str, Any]) -> None:
    from common import cpu_line, mark

    print(cpu_line(report["cpu"]))
    print(f"token path: {report['replies']} replies x {report['tokens_per_reply']} tokens, publisher -> JetStream -> relay -> Redis")
    print(f"{'path':<10} {'events':>8} {'wall s':>8} {'tokens/s':>10} {'relay CPU s':>12} {'tokens/s per relay core':>24}")
    for phase in report["phases"]:
        print(
            f"{phase['mode']:<10} {phase['events']:>8} {phase['wall_s']:>8.2f} {phase['tokens_per_s']:>10.0f}"
            f" {phase['relay_cpu_s']:>12.2f} {phase['tokens_per_relay_cpu_s']:>24.0f}"
        )
    is_met = report["per_core_ratio"] >= report["target_ratio"]
    print(f"batched / single per relay core: {report['per_core_ratio']:.1f}x (target >= {report['target_ratio']:.0f}x) {mark(is_met)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replies", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per reply")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 64 replies x 20 tokens")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--relay", nargs=2, metavar=("NATS_URL", "REDIS_URL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay:
        try:
            import uvloop
        except ImportError:
            asyncio.run(relay_main(*args.relay))
        else:
            uvloop.run(relay_main(*args.relay))
        return
    num_tokens = 20 if args.quick else args.tokens
    with tempfile.TemporaryDirectory(prefix="token-path-") as workdir:
        report = asyncio.run(bench(args.replies, num_tokens, Path(workdir)))
    print_table(report)
    from common import write_json

    write_json(args.out, report)


if __name__ == "__main__":
    main()
