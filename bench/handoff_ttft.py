"""Time to first token of one prompt prefilled remotely (prefill worker -> KV over UCXX -> decode
worker) against the same prompt prefilled locally on the decode worker, through real worker
processes on a real nats-server, in the same run (used by kv_transfer.py).

Each request goes straight to a worker's assign subject (as the router sends it): to the decode
worker for local prefill, to the prefill worker naming the decode worker for remote prefill. The
two alternate; each request has a tenant of its own, so neither finds the other's blocks in a
prefix cache. TTFT is from sending the assignment to the first TokenEvent; the remote first token
comes from the prefill worker before the transfer (it includes the Reserve on the decode worker),
so the second token's time is reported too: it includes the transfer and the commit.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client

from tandem.bus import decode, encode, subjects
from tandem.bus.token_batches import watch_events
from tandem.devstack.bus_users import join_local_bus
from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.servers import init_token_stream, start_nats
from tandem.models.loader import load_tokenizer
from tandem.v1 import common_pb2
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.v1.worker_pb2 import WorkerHeartbeat

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 300.0
REPLY_TIMEOUT_S = 300.0
MAX_TOKENS = 4


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    second_token_s: float


def prompt_of(num_tokens: int) -> list[int]:
    tokenizer = load_tokenizer(None)
    story = " ".join(
        f"Note {i}: the tide turned at the pier and the boats came home with the evening light." for i in range(num_tokens // 10)
    )
    prompt = tokenizer.encode_chat([{"role": "user", "content": story}])
    assert len(prompt) >= num_tokens, (len(prompt), num_tokens)
    return prompt[:num_tokens]


def _worker(role: str, nats_url: str, dtype: str, num_threads: int | None, cpus: str = "") -> tuple[ChildProcess, str]:
    instance_id = f"{role}-bench-{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(join_local_bus(role, instance_id, nats_url))  # its instance's login on the bus, the internal secret
    env.update(
        PYTHONUNBUFFERED="1", TANDEM_HTTP_PORT=str(free_port()), TANDEM_OPS_PORT=str(free_port()), TANDEM_GRPC_PORT=str(free_port()),
        TANDEM_HEARTBEAT_INTERVAL_S="0.2", TANDEM_DTYPE=dtype, TANDEM_KV_CACHE_MIB="256",
    )  # fmt: skip
    if num_threads:
        env["OMP_NUM_THREADS"] = str(num_threads)
    if cpus:  # its own CPUs, one torch thread each
        env["TANDEM_CPU_AFFINITY"] = cpus
    child = ChildProcess(role, [sys.executable, "-m", f"services.{role}"], env=env, cwd=str(REPO))
    child.start()
    return child, instance_id


async def _ready(nc: Client, role: str, instance_id: str) -> WorkerHeartbeat:
    ready: asyncio.Future[WorkerHeartbeat] = asyncio.get_running_loop().create_future()

    async def on_heartbeat(msg) -> None:
        heartbeat = decode(msg.data, WorkerHeartbeat)
        if heartbeat.service.is_ready and heartbeat.is_engine_ready and not ready.done():
            ready.set_result(heartbeat)

    subscription = await nc.subscribe(subjects.heartbeat(role, instance_id), cb=on_heartbeat)
    try:
        return await asyncio.wait_for(ready, READY_TIMEOUT_S)
    finally:
        await subscription.unsubscribe()


async def _time_one(nc: Client, worker_id: str, assignment: Assignment) -> Timing:
    arrivals: list[float] = []
    done = asyncio.get_running_loop().create_future()

    async def on_event(event: TokenEvent) -> None:
        arrivals.append(time.perf_counter())
        if event.finish != common_pb2.FINISH_REASON_UNSPECIFIED and not done.done():
            done.set_result(event)

    subscription = await watch_events(nc, on_event, assignment.reply_id)
    await nc.flush()
    started_s = time.perf_counter()
    answer = decode((await nc.request(subjects.assign(worker_id), encode(assignment), timeout=30)).data, AssignmentReply)
    assert answer.WhichOneof("outcome") == "accepted", answer
    last = await asyncio.wait_for(done, REPLY_TIMEOUT_S)
    await subscription.unsubscribe()
    assert last.finish != common_pb2.FINISH_REASON_ERROR and len(arrivals) >= 2, (last, len(arrivals))
    return Timing(arrivals[0] - started_s, arrivals[1] - started_s)


def _assignment(prompt: list[int]) -> Assignment:
    reply_id = uuid.uuid4().hex
    request = GenerateRequest(
        model="auto", tenant=f"bench-{reply_id}", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS)
    )
    return Assignment(reply_id=reply_id, request=request, first_seq=1)


async def _measure(nats_url: str, prompt: list[int], repeats: int, dtype: str, num_threads: int | None, cpus: tuple[str, str]) -> dict:
    prefill, prefill_id = _worker("prefill", nats_url, dtype, num_threads, cpus[0])
    decode_child, decode_id = _worker("decode", nats_url, dtype, num_threads, cpus[1])
    nc = await nats.connect(nats_url)
    try:
        await _ready(nc, "prefill", prefill_id)
        decode_heartbeat = await _ready(nc, "decode", decode_id)
        local, remote = [], []
        for _ in range(repeats + 1):  # the first pair warms both paths up (connections, pages)
            local.append(await _time_one(nc, decode_id, _assignment(prompt)))
            assignment = _assignment(prompt)
            assignment.decode_worker_id, assignment.decode_grpc_address = decode_id, decode_heartbeat.grpc_address
            remote.append(await _time_one(nc, prefill_id, assignment))
        return {"local": local[1:], "remote": remote[1:]}
    finally:
        await nc.close()
        prefill.stop(timeout_s=10)
        decode_child.stop(timeout_s=10)


def measure_ttft(num_tokens: int, repeats: int, dtype: str, num_threads: int | None, cpus: tuple[str, str] = ("", "")) -> dict:
    """Medians over `repeats` alternating pairs; the JSON fields kv_transfer.py reports. `cpus`:
    the prefill and the decode worker's TANDEM_CPU_AFFINITY (empty: all)."""
    prompt = prompt_of(num_tokens)
    with tempfile.TemporaryDirectory() as workdir:
        server = start_nats(Path(workdir))
        init_token_stream(server)
        try:
            runs = asyncio.run(_measure(server.url, prompt, repeats, dtype, num_threads, cpus))
        finally:
            server.stop()

    def median_ms(timings: list[Timing], field: str) -> float:
        return 1e3 * statistics.median(getattr(t, field) for t in timings)

    local_ttft_ms, remote_ttft_ms = median_ms(runs["local"], "ttft_s"), median_ms(runs["remote"], "ttft_s")
    local_second_ms, remote_second_ms = median_ms(runs["local"], "second_token_s"), median_ms(runs["remote"], "second_token_s")
    return {
        "remote_minus_local_ttft_ms": remote_ttft_ms - local_ttft_ms,
        "remote_minus_local_second_token_ms": remote_second_ms - local_second_ms,
        "local_ttft_ms": local_ttft_ms,
        "remote_ttft_ms": remote_ttft_ms,
        "local_second_token_ms": local_second_ms,
        "remote_second_token_ms": remote_second_ms,
        "ttft_num_prompt_tokens": len(prompt),
        "ttft_repeats": repeats,
        "worker_cpus": {"prefill": cpus[0] or "all", "decode": cpus[1] or "all"},
        "ttft_runs_ms": {side: [[1e3 * t.ttft_s, 1e3 * t.second_token_s] for t in timings] for side, timings in runs.items()},
    }
