"""The token path alone: publisher -> JetStream -> the relay's consumer -> the Redis token log, on a
real nats-server and a redis-server with one replica (tandem.devstack's Redis set, as `tandem up
--ha` starts it), no model and no other service. Three ways side by side on the same servers:

- `single`: today's worker before batches: every reply's event of a step published on its own
  subject (`tandem.v1.tokens.<reply_id>`), all of a step's publishes in flight together, each
  awaiting its acknowledgement; the relay appends and acknowledges each event on its own;
- `batched`: one TokenBatch per step for all replies (`tandem.v1.tokens.batch.<worker_id>`),
  appended with one pipelined Redis call and acknowledged once;
- `batched+wait`: the same batches, through a relay started with `--redis-wait-replicas 1` (as
  under `tandem up --ha`): each append acknowledged only once Redis `WAIT` says the replica holds
  it (tandem.tokenlog.replicated). Its figures beside `batched`'s are what that promise costs.

`single` and `batched` share one relay process, `batched+wait` has its own (the relays would
share the durable consumer's deliveries otherwise). The bench process also times single-event
appends to the primary itself, with and without the WAIT, for the latency it adds per append.

The relay (services/relay/consumer.py and appender.py, under uvloop as the service runs) is a
process of its own, so its CPU time (/proc/<pid>/stat) over each phase gives tokens per second
per relay core, the figure the fleet sizes relays by. Wall-clock tokens/s is printed beside it;
on a machine with fewer cores than processes here it is the publisher's and the servers' too.

    python bench/token_path.py [--replies 64] [--tokens 200] [--appends 500] [--quick] [--out token_path.json]

bench/common.py (and torch with it) is imported by the measuring process only, never the relay's."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import nats
from redis.asyncio import Redis

from tandem.bus.token_batches import BatchNumbers, batches, publish_batch
from tandem.bus.token_stream import STREAM, ensure_token_stream, publish_token
from tandem.config import load_settings
from tandem.devstack.redis_ha import SentinelTiming, start_redis_ha
from tandem.devstack.secrets import with_login
from tandem.devstack.servers import start_nats
from tandem.tokenlog import ReplyKeys, TokenLogWriter
from tandem.tokenlog.replicated import NotReplicated, ReplicationConfig, on_replicas
from tandem.v1.common_pb2 import FINISH_REASON_STOP, Usage
from tandem.v1.tokens_pb2 import TokenEvent

TARGET_RATIO = 5.0  # batched tokens per relay CPU second over single's
WORKER = "decode-bench"
READY = "relay ready"
DONE_TIMEOUT_S = 300.0
WAIT_MODE = "batched+wait"
NUM_REPLICAS = 1  # the relay's redis_wait_replicas under `tandem up --ha`
SYNC_TIMEOUT_S = 30.0
NO_FAILOVER = SentinelTiming(down_after_ms=600_000)  # a busy host's slow answer must not look like a dead primary


def relay_replication(num_wait_replicas: int) -> ReplicationConfig:
    """What services/relay/app.py builds from the relay's settings, given `--redis-wait-replicas`."""
    settings = load_settings(["--redis-wait-replicas", str(num_wait_replicas)], prog="relay")
    return ReplicationConfig(settings.redis_wait_replicas, settings.redis_wait_timeout_ms)


async def relay_main(nats_url: str, redis_url: str, num_wait_replicas: int) -> None:
    """The relay's consumer and appender, no output check, in this process until killed."""
    from services.relay.appender import LogAppender
    from services.relay.consumer import TokenConsumer, TokenConsumerConfig
    from tandem.runtime.runtime import short_command_client

    client = await nats.connect(nats_url)
    redis = short_command_client(redis_url, 64, {})  # as the relay's runtime makes it
    writer = TokenLogWriter(redis, ttl_s=600, running_ttl_s=600)
    appender = LogAppender(writer, None, lambda event: None, relay_replication(num_wait_replicas))
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


async def num_waits(redis: Redis) -> int:
    """WAIT commands the server has run so far (its commandstats): the proof a phase waited."""
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


async def run_phase(mode: str, js: Any, redis: Redis, relay_pid: int, num_replies: int, num_tokens: int) -> dict[str, Any]:
    from procs import cpu_s

    reply_ids = [f"bench-{mode.replace('+', '-')}-{uuid.uuid4().hex[:10]}-{i}" for i in range(num_replies)]  # ids allow no "+"
    publish = publish_single if mode == "single" else publish_batched
    waits_before = await num_waits(redis)
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
        "redis_waits": await num_waits(redis) - waits_before,
    }


async def in_sync(redis: Redis, num_replicas: int) -> None:
    """Until `num_replicas` replicas are online at the primary's replication offset."""
    deadline_s = time.monotonic() + SYNC_TIMEOUT_S
    while True:
        info = await redis.info("replication")
        replicas = [info[f"slave{i}"] for i in range(int(info["connected_slaves"]))]
        num_in_sync = sum(r["state"] == "online" and int(r["offset"]) == int(info["master_repl_offset"]) for r in replicas)
        if num_in_sync >= num_replicas:
            return
        if time.monotonic() > deadline_s:
            raise SystemExit(f"{num_in_sync} of {num_replicas} Redis replicas in sync after {SYNC_TIMEOUT_S} s")
        await asyncio.sleep(0.05)


async def drained(js: Any) -> None:
    """Until the relay has acknowledged every message, so that a relay started next on the durable
    consumer is not handed this one's work again."""
    from services.relay.consumer import TokenConsumerConfig

    deadline_s = time.monotonic() + DONE_TIMEOUT_S
    while True:
        info = await js.consumer_info(STREAM, TokenConsumerConfig().durable)
        if info.num_ack_pending == 0 and info.num_pending == 0:
            return
        if time.monotonic() > deadline_s:
            raise SystemExit(f"the relay left {info.num_ack_pending} messages unacknowledged for {DONE_TIMEOUT_S} s")
        await asyncio.sleep(0.02)


async def append_latency(redis: Redis, replication: ReplicationConfig, num_appends: int) -> dict[str, Any]:
    """One event per append_many, from this process to the primary: alone, then on `on=` a pinned
    connection followed by its WAIT (on_replicas, as the relay's appender calls it), alternating so
    both see the same host load."""
    writer = TokenLogWriter(redis, ttl_s=600, running_ttl_s=600)
    plain_ms: list[float] = []
    waited_ms: list[float] = []
    num_not_replicated = 0
    plain_id, waited_id = (f"bench-append-{kind}-{uuid.uuid4().hex[:10]}" for kind in ("plain", "wait"))
    for seq in range(1, num_appends + 1):
        plain, waited = step_events([plain_id, waited_id], seq, num_appends + 1)  # never final: no store to settle
        started_s = time.perf_counter()
        await writer.append_many([plain])
        plain_ms.append((time.perf_counter() - started_s) * 1000)
        started_s = time.perf_counter()
        try:
            await on_replicas(redis, replication, lambda client, event=waited: writer.append_many([event], on=client))
        except NotReplicated:
            num_not_replicated += 1  # timed all the same: it waited
        waited_ms.append((time.perf_counter() - started_s) * 1000)
    plain_p50_ms, waited_p50_ms = statistics.median(plain_ms), statistics.median(waited_ms)
    return {
        "appends": num_appends,
        "append_ms_p50": round(plain_p50_ms, 3),
        "append_wait_ms_p50": round(waited_p50_ms, 3),
        "extra_ms_per_append_p50": round(waited_p50_ms - plain_p50_ms, 3),
        "append_ms_mean": round(statistics.fmean(plain_ms), 3),
        "append_wait_ms_mean": round(statistics.fmean(waited_ms), 3),
        "appends_not_replicated": num_not_replicated,
    }


WAIT_COST_MEANING = {
    "replicas": "replicas each append waits for (the relay's --redis-wait-replicas)",
    "wait_timeout_ms": "the longest one WAIT may take (the relay's redis_wait_timeout_ms)",
    "tokens_per_s_ratio": "batched+wait over batched, wall-clock tokens/s of the whole path",
    "per_core_ratio": "batched+wait over batched, tokens per relay CPU second",
    "appends": "single-event append_many calls timed each way from the bench process",
    "append_ms_p50": "median ms of one append_many([event]) without on= (no WAIT)",
    "append_wait_ms_p50": "median ms of one append_many([event], on=pinned) plus its WAIT (on_replicas)",
    "extra_ms_per_append_p50": "append_wait_ms_p50 - append_ms_p50: the replica's acknowledgement per append",
    "append_ms_mean": "mean of the same without WAIT",
    "append_wait_ms_mean": "mean of the same with WAIT",
    "appends_not_replicated": "WAITs that timed out (NotReplicated), still timed",
}


async def start_relay(nats_url: str, redis_url: str, num_wait_replicas: int) -> asyncio.subprocess.Process:
    argv = [__file__, "--relay", nats_url, redis_url, "--redis-wait-replicas", str(num_wait_replicas)]
    relay = await asyncio.create_subprocess_exec(sys.executable, *argv, stdout=asyncio.subprocess.PIPE)
    assert relay.stdout is not None
    line = await asyncio.wait_for(relay.stdout.readline(), 60)
    if line.decode().strip() != READY:
        relay.kill()
        raise SystemExit(f"the relay did not start: {line!r}")
    return relay


async def stop(relay: asyncio.subprocess.Process) -> None:
    relay.kill()
    await relay.wait()


async def bench(num_replies: int, num_tokens: int, num_appends: int, workdir: Path) -> dict[str, Any]:
    from common import cpu_host

    bus = start_nats(workdir / "nats")
    redis_set = start_redis_ha(workdir / "redis", num_replicas=NUM_REPLICAS, timing=NO_FAILOVER)
    redis_url = with_login(redis_set.nodes[0].address, "", redis_set.secrets.redis_password)
    replication = relay_replication(NUM_REPLICAS)
    relay = None
    try:
        client = await nats.connect(bus.url)
        redis = Redis.from_url(redis_url)
        await in_sync(redis, NUM_REPLICAS)
        js = await ensure_token_stream(client)
        warm_tokens = max(2, num_tokens // 10)
        phases = []
        for modes, num_wait_replicas in ((("single", "batched"), 0), ((WAIT_MODE,), NUM_REPLICAS)):
            relay = await start_relay(bus.url, redis_url, num_wait_replicas)
            for mode in modes:  # each path once before it is measured
                await run_phase(mode, js, redis, relay.pid, num_replies, warm_tokens)
            phases += [await run_phase(mode, js, redis, relay.pid, num_replies, num_tokens) for mode in modes]
            await drained(js)
            await stop(relay)
            relay = None
        latency = await append_latency(redis, replication, num_appends)
        await redis.aclose()
        await client.close()
    finally:
        if relay is not None:
            await stop(relay)
        bus.stop()
        redis_set.stop()
    single, batched, waited = phases
    ratio = batched["tokens_per_relay_cpu_s"] / single["tokens_per_relay_cpu_s"]
    wait_cost = {
        "replicas": replication.num_replicas,
        "wait_timeout_ms": replication.timeout_ms,
        "tokens_per_s_ratio": round(waited["tokens_per_s"] / batched["tokens_per_s"], 3),
        "per_core_ratio": round(waited["tokens_per_relay_cpu_s"] / batched["tokens_per_relay_cpu_s"], 3),
        **latency,
        "meaning": WAIT_COST_MEANING,
    }
    return {
        "replies": num_replies,
        "tokens_per_reply": num_tokens,
        "phases": phases,
        "per_core_ratio": round(ratio, 2),
        "target_ratio": TARGET_RATIO,
        "wait_cost": wait_cost,
        "cpu": cpu_host(),
    }


def print_table(report: dict[str, Any]) -> None:
    from common import cpu_line, mark

    print(cpu_line(report["cpu"]))
    print(f"token path: {report['replies']} replies x {report['tokens_per_reply']} tokens, publisher -> JetStream -> relay -> Redis")
    print(f"{'path':<13} {'events':>8} {'wall s':>8} {'tokens/s':>10} {'relay CPU s':>12} {'tokens/s per relay core':>24}")
    for phase in report["phases"]:
        print(
            f"{phase['mode']:<13} {phase['events']:>8} {phase['wall_s']:>8.2f} {phase['tokens_per_s']:>10.0f}"
            f" {phase['relay_cpu_s']:>12.2f} {phase['tokens_per_relay_cpu_s']:>24.0f}"
        )
    is_met = report["per_core_ratio"] >= report["target_ratio"]
    print(f"batched / single per relay core: {report['per_core_ratio']:.1f}x (target >= {report['target_ratio']:.0f}x) {mark(is_met)}")
    cost = report["wait_cost"]
    print(
        f"WAIT {cost['replicas']} cost, {WAIT_MODE} / batched: {cost['tokens_per_s_ratio']:.2f}x tokens/s,"
        f" {cost['per_core_ratio']:.2f}x per relay core; one single-event append {cost['append_ms_p50']:.2f} ms ->"
        f" {cost['append_wait_ms_p50']:.2f} ms p50 (+{cost['extra_ms_per_append_p50']:.2f} ms, {cost['appends']} appends"
        f" each way, {cost['appends_not_replicated']} not replicated in {cost['wait_timeout_ms']} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replies", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per reply")
    parser.add_argument("--appends", type=int, default=500, help="single-event appends timed with and without WAIT")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 64 replies x 20 tokens, 100 appends")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--relay", nargs=2, metavar=("NATS_URL", "REDIS_URL"), help=argparse.SUPPRESS)
    parser.add_argument("--redis-wait-replicas", type=int, default=0, help=argparse.SUPPRESS)  # the relay's
    args = parser.parse_args()
    if args.relay:
        relay = relay_main(*args.relay, args.redis_wait_replicas)
        try:
            import uvloop
        except ImportError:
            asyncio.run(relay)
        else:
            uvloop.run(relay)
        return
    num_tokens, num_appends = (20, 100) if args.quick else (args.tokens, args.appends)
    with tempfile.TemporaryDirectory(prefix="token-path-") as workdir:
        report = asyncio.run(bench(args.replies, num_tokens, num_appends, Path(workdir)))
    print_table(report)
    from common import write_json

    write_json(args.out, report)


if __name__ == "__main__":
    main()
