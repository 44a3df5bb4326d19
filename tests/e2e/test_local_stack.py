"""`make run` (that is, `tandem up`): every process comes up, the small model's int8 decode worker
beside the large model's, /readyz answers on the chat's ops port (as announced), GET /v1/models lists both models
and each answers by name, one chat message shows its latency, KV and prefix-cache figures on chat's
and the worker's /metrics, a SIGKILLed service is reported and restarted, and Ctrl-C leaves nothing
behind.

One `make run` serves the whole module (starting one takes most of a minute). The tests run in
file order, and the last one stops it: its Ctrl-C is what it tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import nats
import pytest
from helpers import REPO, interrupt_and_wait, next_heartbeat, wait_until
from product_stack import Sse, read_stream
from scraped_metrics import Samples, grew, is_exported, scrape, total

from tandem.devstack.proc import ChildProcess, free_port
from tandem.models.files import EMBEDDED_MODEL_NAME
from tandem.models.loader import resolve_dtype
from tandem.tls import TlsSettings, nats_tls_options
from tandem.v1.worker_pb2 import WorkerHeartbeat

UP_TIMEOUT_S = 180
ROLES = ("router", "relay", "prefill", "decode", "chat")
SMALL_WORKER = "small-decode-0"
LARGE_MODEL, SMALL_MODEL = EMBEDDED_MODEL_NAME, f"{EMBEDDED_MODEL_NAME}-int8"
WORKER_IDS = {LARGE_MODEL: "decode-0", SMALL_MODEL: "small-decode-0"}  # instance ids, as the stack names them
LINES_KEPT = 20_000  # every child's log goes through make's output: keep the start lines for the later tests
POLL_S = 0.05  # between scrapes while a reply runs


@dataclass
class MakeRun:
    up: ChildProcess
    url: str  # the chat port
    ops_url: str  # the chat's ops port: /readyz, /metrics
    api_key: str
    bus_env: dict[str, str]  # TANDEM_NATS_URL with the operator's login, and the operator's TANDEM_TLS_* files
    pids: dict[str, int]  # from the "started (pid N)" lines; a process without one is missing

    @property
    def nats_url(self) -> str:
        return self.bus_env["TANDEM_NATS_URL"]

    @property
    def nats_tls(self) -> dict[str, object]:
        """nats.connect's TLS arguments for the operator's certificate."""
        env = self.bus_env
        return nats_tls_options(
            TlsSettings(ca_file=env["TANDEM_TLS_CA_FILE"], cert_file=env["TANDEM_TLS_CERT_FILE"], key_file=env["TANDEM_TLS_KEY_FILE"])
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, only not yet reaped
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _announced(up: ChildProcess) -> MakeRun:
    ready = up.wait_for_line(r"Tandem is up at (http://\S+)", UP_TIMEOUT_S)
    assert ready is not None, up.recent_output(40)
    pids = {}
    launcher = up.wait_for_line(r"^up\s*\| starting the local stack \(pid (\d+)\)", 1)
    if launcher is not None:
        pids["tandem up"] = int(launcher[1])
    for name in (*ROLES, SMALL_WORKER, "nats", "redis"):
        if started := up.wait_for_line(rf"^up\s*\| {name} started \(pid (\d+)\)", 1):
            pids[name] = int(started[1])
    ops = up.wait_for_line(r"try: curl -s (http://\S+)/readyz", 1)
    assert ops is not None, up.recent_output(40)
    api_key = up.wait_for_line(r"API key: (tdm-dev-\S+)", 1)
    bus = up.wait_for_line(r"internal clients: ((?:TANDEM_\w+=\S+ )+)tandem generate", 1)
    assert api_key is not None and bus is not None, up.recent_output(40)
    bus_env = dict(assignment.split("=", 1) for assignment in bus[1].split())
    return MakeRun(up=up, url=ready[1], ops_url=ops[1], api_key=api_key[1], bus_env=bus_env, pids=pids)


@pytest.fixture(scope="module")
def make_run() -> Iterator[MakeRun]:
    env = {**_env(), "TANDEM_HTTP_PORT": str(free_port())}
    up = ChildProcess("make", ["make", "--no-print-directory", "run"], env=env, cwd=str(REPO), num_lines_kept=LINES_KEPT)
    up.start()  # in a session of its own: killpg is a terminal's Ctrl-C
    try:
        yield _announced(up)
    finally:
        if up.poll() is None:  # the last test stops it itself
            interrupt_and_wait(up)


async def _worker_heartbeats(make_run: MakeRun) -> dict[str, WorkerHeartbeat]:
    """model -> the next ready heartbeat of the worker the stack runs for it (its /metrics is at
    .service.http_url: the stack gives workers free ports and prints none of them)."""
    nc = await nats.connect(make_run.nats_url, **make_run.nats_tls)
    try:
        heartbeats = {}
        for model, instance_id in WORKER_IDS.items():
            heartbeat = await next_heartbeat(nc, "decode", instance_id, accept=lambda hb: hb.is_ready, timeout_s=30)
            assert isinstance(heartbeat, WorkerHeartbeat)
            heartbeats[model] = heartbeat
        return heartbeats
    finally:
        await nc.close()


async def _send(client: httpx.AsyncClient, make_run: MakeRun, content: str, **body: object) -> list[Sse]:
    conversation = await client.post("/v1/conversations", headers=make_run.headers, json={})
    assert conversation.status_code == 201, conversation.text
    async with client.stream(
        "POST",
        f"/v1/conversations/{conversation.json()['id']}/messages",
        headers={**make_run.headers, "Accept": "text/event-stream"},
        json={"content": content, "temperature": 0, **body},
    ) as response:
        return await read_stream(response)


def test_make_run_starts_every_process_with_the_large_model_s_and_the_int8_small_model_s_decode_workers(make_run):
    up = make_run.up
    for name in ("tandem up", *ROLES, SMALL_WORKER, "nats", "redis"):
        assert name in make_run.pids, f"no start line for {name}"
        assert _is_running(make_run.pids[name]), name
    announced = up.wait_for_line(r"^up\s*\| models: (\S+) \(large\), (\S+) \(small, 1 small-decode worker", 1)
    assert announced is not None, up.recent_output(40)
    assert (announced[1], announced[2]) == (LARGE_MODEL, SMALL_MODEL)
    engines = {}
    for name in ("decode", SMALL_WORKER):
        engine = up.wait_for_line(rf"^{name}\s*\|.*engine ready: (\S+), torch\.(\w+) \(quantization (\w+)\) on (\S+)", 1)
        assert engine is not None, f"{name} logged no engine ready line"
        engines[name] = engine.groups()
    large_dtype = str(resolve_dtype("auto", engines["decode"][3])).removeprefix("torch.")  # bf16 where the device computes it
    assert engines["decode"][:3] == (LARGE_MODEL, large_dtype, "none")
    assert engines[SMALL_WORKER][0] == SMALL_MODEL and engines[SMALL_WORKER][2] == "int8"


async def test_both_decode_workers_heartbeat_ready_each_with_its_model(make_run):
    heartbeats = await _worker_heartbeats(make_run)
    for model, heartbeat in heartbeats.items():
        assert heartbeat.model == model and heartbeat.is_engine_ready, (model, heartbeat)
        assert heartbeat.service.instance_id == WORKER_IDS[model]


def _chat_over_http(url: str, api_key: str) -> None:
    """A person's path: the page loads, a conversation is made, a message streams its answer."""
    headers = {"Authorization": f"Bearer {api_key}"}
    assert "<html" in httpx.get(url, timeout=10).text.lower()
    conversation = httpx.post(f"{url}/v1/conversations", headers=headers, json={}, timeout=10)
    assert conversation.status_code == 201, conversation.text
    body = {"content": "What is the capital of France?", "temperature": 0, "max_tokens": 16}
    with httpx.stream(
        "POST", f"{url}/v1/conversations/{conversation.json()['id']}/messages", headers=headers, json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[0] == "meta" and events[-1] == "done", lines
    assert "Paris" in "".join(line for line in lines if line.startswith("data: ")), lines


def test_make_run_answers_a_chat_message_over_http_and_a_generate_over_the_bus(make_run):
    assert httpx.get(f"{make_run.ops_url}/readyz", timeout=10).status_code == 200
    _chat_over_http(make_run.url, make_run.api_key)
    answer = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", "--via-bus", "What is the capital of France?"],
        env={**_env(), **make_run.bus_env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answer.returncode == 0, answer.stderr
    assert "Paris" in answer.stdout, "router -> decode worker -> TokenEvents, over the stack's NATS"


async def test_v1_models_lists_both_models_and_the_small_one_answers_when_named(make_run):
    async with httpx.AsyncClient(base_url=make_run.url, timeout=120) as client:

        async def listed() -> list[str]:
            response = await client.get("/v1/models", headers=make_run.headers)
            assert response.status_code == 200, response.text
            ids = sorted(model["id"] for model in response.json()["data"])
            return ids if ids == sorted((LARGE_MODEL, SMALL_MODEL)) else []

        await wait_until(listed, timeout_s=30)  # chat learns the served models from the workers' heartbeats
        events = await _send(client, make_run, "Hello! How are you today?", model=SMALL_MODEL, max_tokens=8)
    meta, done = events[0], events[-1]
    assert (meta.event, done.event) == ("meta", "done"), events
    assert (meta.data["model"], meta.data["route"]["decided_by"], done.data["model"]) == (SMALL_MODEL, "user", SMALL_MODEL)
    assert done.data["usage"]["output"] > 0


async def _peak_kv_usage(client: httpx.AsyncClient, worker_url: str, model: str, done: asyncio.Event) -> float:
    """The highest KV usage the worker reports while `done` is not set."""
    peak = 0.0
    while not done.is_set():
        samples = await scrape(client, worker_url)
        peak = max(peak, total(samples, "tandem_worker_kv_cache_usage_ratio", role="decode", model=model))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), POLL_S)
    return peak


async def test_after_one_chat_message_chat_and_its_worker_show_ttft_itl_kv_and_prefix_cache_figures(make_run):
    """Issue 14's "done when", on `make run`: one message to the large model (named, so the worker
    to watch is known), then chat's latency histograms and the worker's prefix-cache counters have
    grown. KV usage is sampled per engine step and reads 0 again once the worker is idle, so it is
    watched while the reply streams; after the reply, tandem_worker_kv_cache_prefix_cached_ratio
    (the reusable KV the worker keeps) is the KV figure that stays above 0."""
    worker_url = (await _worker_heartbeats(make_run))[LARGE_MODEL].service.http_url
    async with httpx.AsyncClient(base_url=make_run.url, timeout=120) as client:
        chat_before, worker_before = await scrape(client, make_run.ops_url), await scrape(client, worker_url)
        done = asyncio.Event()
        watching = asyncio.create_task(_peak_kv_usage(client, worker_url, LARGE_MODEL, done))
        try:
            events = await _send(client, make_run, "Tell me a long story about a lighthouse keeper.", model=LARGE_MODEL, max_tokens=32)
        finally:
            done.set()
        peak = await watching
        assert events[-1].event == "done" and events[-1].data["model"] == LARGE_MODEL, events[-1]
        usage = events[-1].data["usage"]
        chat_after = await scrape(client, make_run.ops_url)  # chat observed the reply before it wrote `done`
        worker_scrapes: list[Samples] = []

        async def worker_counted_the_reply() -> bool:
            # The worker's counters change on its engine thread after a step, which its token
            # events may outrun to the client: polled until its output tokens are counted.
            worker_scrapes.append(await scrape(client, worker_url))
            generated = grew(worker_before, worker_scrapes[-1], "tandem_worker_generation_tokens_total", role="decode", model=LARGE_MODEL)
            return generated >= usage["output"]

        await wait_until(worker_counted_the_reply, timeout_s=10)
        worker_after = worker_scrapes[-1]

    assert sum(1 for event in events if event.event == "delta" and event.data["text"]) >= 2, "the reply streamed content"

    chat = {"tier": "plus", "model": LARGE_MODEL}  # the dev key's tier
    assert grew(chat_before, chat_after, "tandem_chat_time_to_first_token_seconds_count", **chat) == 1
    assert grew(chat_before, chat_after, "tandem_chat_time_to_first_token_seconds_sum", **chat) > 0
    assert grew(chat_before, chat_after, "tandem_chat_inter_token_latency_seconds_count", **chat) >= 1
    assert grew(chat_before, chat_after, "tandem_chat_inter_token_latency_seconds_sum", **chat) > 0
    assert grew(chat_before, chat_after, "tandem_chat_e2e_latency_seconds_count", **chat) == 1

    worker = {"role": "decode", "model": LARGE_MODEL}
    assert grew(worker_before, worker_after, "tandem_worker_prefix_cache_queries_tokens_total", **worker) >= usage["input"]
    assert is_exported(worker_after, "tandem_worker_prefix_cache_hits_tokens_total")
    assert grew(worker_before, worker_after, "tandem_worker_generation_tokens_total", **worker) >= usage["output"] > 0
    assert 0 < peak <= 1, "tandem_worker_kv_cache_usage_ratio is above 0 while the reply runs"
    assert 0 < total(worker_after, "tandem_worker_kv_cache_prefix_cached_ratio", **worker) <= 1, "the reply's prefix stays cached"
    # the worker's time to first token is the inner part of the chat's: from its arrival at the worker
    assert grew(worker_before, worker_after, "tandem_worker_time_to_first_token_seconds_count", **worker, lane="paid") == 1
    worker_ttft_s = grew(worker_before, worker_after, "tandem_worker_time_to_first_token_seconds_sum", **worker, lane="paid")
    assert 0 < worker_ttft_s < grew(chat_before, chat_after, "tandem_chat_time_to_first_token_seconds_sum", **chat)


def test_make_run_restarts_a_killed_service_and_ctrl_c_leaves_nothing_behind(make_run):
    """Last in the module: it stops the module's `make run`."""
    up, pids = make_run.up, dict(make_run.pids)
    try:
        mark = up.num_lines
        os.kill(pids["decode"], signal.SIGKILL)
        reported = up.wait_for_line(r"decode exited \(killed by SIGKILL\); restarting in (\d+) s", 60, since=mark)
        assert reported is not None, up.recent_output(40)
        restarted = up.wait_for_line(r"^up\s*\| decode started \(pid (\d+)\)", 60, since=mark)
        assert restarted is not None, up.recent_output(40)
        assert int(restarted[1]) != pids["decode"]
        pids["decode (restarted)"] = int(restarted[1])
        assert up.wait_for_line(r"^up\s*\| decode ready", UP_TIMEOUT_S, since=mark) is not None
        assert httpx.get(f"{make_run.ops_url}/readyz", timeout=10).status_code == 200
    finally:
        interrupt_and_wait(up)
    assert up.wait_for_line(r"^up\s*\| stopped; nothing left running", 1) is not None, up.recent_output(40)
    left = {name: pid for name, pid in pids.items() if _is_running(pid)}
    assert not left, f"still running after Ctrl-C: {left}"


def test_up_refuses_a_malformed_key_list_in_one_line():
    env = {**_env(), "TANDEM_API_KEYS": "key-without-user"}
    result = subprocess.run([sys.executable, "-m", "tandem.cli", "up"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tandem up: error: TANDEM_API_KEYS: entry 'key-without-user' must look like key=user:tier (tier one of free, plus, pro)"
    ]
    assert result.stdout == ""


def test_up_refuses_a_busy_chat_port_before_starting_anything():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "up", "--port", str(port)],
            env=_env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"tandem up: error: chat: port {port} on 127.0.0.1 is in use: stop what holds it or set TANDEM_HTTP_PORT or --port"
    )
    assert "started" not in result.stdout
