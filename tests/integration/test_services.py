"""Every service as a real process against real NATS and Redis: health, readiness, metrics on its
ops port (never on its HTTP port), heartbeats, the workers' gRPC control, and a clean exit 0 on
SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
import torch
from helpers import REPO, next_heartbeat, ops_url, service_env, service_process

from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.servers import EmbeddedServer
from tandem.v1 import control_pb2, control_pb2_grpc
from tandem.worker.internal_grpc import internal_channel

ROLES = ("prefill", "decode", "router", "relay", "chat")


class Running:
    def __init__(self, role: str, env: dict[str, str], child: ChildProcess) -> None:
        self.role, self.env, self.child = role, env, child
        self.url = f"http://127.0.0.1:{env['TANDEM_HTTP_PORT']}"
        self.ops_url = ops_url(env)
        self.instance_id = env["TANDEM_INSTANCE_ID"]


@pytest.fixture
def start_service(nats_server: EmbeddedServer, redis_server: EmbeddedServer) -> Iterator:
    started: list[ChildProcess] = []

    def start(role: str, **extra: str) -> Running:
        env = service_env(role, nats_server.url, redis_server.url, **extra)
        child = service_process(role, env)
        child.start()
        started.append(child)
        return Running(role, env, child)

    yield start
    for child in started:
        child.stop(timeout_s=10)


@pytest.mark.parametrize("role", ROLES)
async def test_service_is_ready_heartbeats_and_exits_zero_on_sigterm(role, start_service, nc):
    service = start_service(role)
    heartbeat = await next_heartbeat(nc, role, service.instance_id, accept=lambda hb: hb.is_ready)
    service_heartbeat = heartbeat.service if role in ("prefill", "decode") else heartbeat
    assert service_heartbeat.http_url == service.ops_url
    async with httpx.AsyncClient(base_url=service.url) as http:
        for path in ("/metrics", "/readyz", "/healthz", "/openapi.json", "/docs"):
            assert (await http.get(path)).status_code == 404, f"{path} on the HTTP port"
    async with httpx.AsyncClient(base_url=service.ops_url) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok", "role": role}
        ready = await http.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"]["nats"] is True
        body = (await http.get("/metrics")).text
        assert "tandem_heartbeats_sent_total" in body
        assert f'role="{role}"' in body
    service.child.process.send_signal(signal.SIGTERM)
    assert service.child.process.wait(timeout=10) == 0, service.child.recent_output()


async def test_a_service_without_redis_is_alive_but_not_ready(start_service, nc):
    service = start_service("relay", TANDEM_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    await next_heartbeat(nc, "relay", service.instance_id, accept=lambda hb: not hb.is_ready)
    async with httpx.AsyncClient(base_url=service.ops_url) as http:
        assert (await http.get("/healthz")).status_code == 200
        ready = await http.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["redis"] is False


async def test_worker_control_health_stats_and_drain(start_service, nc):
    worker = start_service("decode")
    await next_heartbeat(nc, "decode", worker.instance_id, accept=lambda hb: hb.is_ready)
    address = f"127.0.0.1:{worker.env['TANDEM_GRPC_PORT']}"
    async with internal_channel(address, worker.env.get("TANDEM_INTERNAL_SECRET", "")) as channel:
        control = control_pb2_grpc.WorkerControlStub(channel)
        health = await control.Health(control_pb2.HealthRequest(), timeout=10)
        assert health.status == control_pb2.HealthReply.STATUS_SERVING
        stats = await control.Stats(control_pb2.StatsRequest(), timeout=10)
        assert stats.model == "SmolLM2-135M-Instruct"
        assert stats.kv_block_size == 16
        assert (await control.Drain(control_pb2.DrainRequest(), timeout=10)).was_draining is False
        assert (await control.Drain(control_pb2.DrainRequest(), timeout=10)).was_draining is True
        health = await control.Health(control_pb2.HealthRequest(), timeout=10)
        assert health.status == control_pb2.HealthReply.STATUS_NOT_SERVING
        assert "not_draining" in health.detail
    draining = await next_heartbeat(nc, "decode", worker.instance_id, accept=lambda hb: hb.is_draining)
    assert not draining.service.is_ready
    async with httpx.AsyncClient(base_url=worker.ops_url) as http:
        assert (await http.get("/readyz")).status_code == 503


async def test_router_sees_live_workers(start_service, nc):
    router = start_service("router")
    await next_heartbeat(nc, "router", router.instance_id, accept=lambda hb: hb.is_ready)
    worker = start_service("prefill")
    await next_heartbeat(nc, "prefill", worker.instance_id, accept=lambda hb: hb.is_ready)
    # The router subscribed before it said it was ready; one more heartbeat has reached it too.
    await next_heartbeat(nc, "prefill", worker.instance_id)
    async with httpx.AsyncClient(base_url=router.url) as http:
        live = (await http.get("/workers")).json()
    assert worker.instance_id in [w["instance_id"] for w in live["prefill"]]


def _start_failing(role: str, nats_url: str, redis_url: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = service_env(role, nats_url, redis_url, **extra)
    return subprocess.run([sys.executable, "-m", f"services.{role}"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)


def _one_clear_line(result: subprocess.CompletedProcess[str], role: str, *fragments: str) -> None:
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"tandem {role}: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_malformed_api_keys_fail_at_start(nats_server, redis_server):
    result = _start_failing("chat", nats_server.url, redis_server.url, TANDEM_API_KEYS="alice:plus")
    _one_clear_line(result, "chat", "TANDEM_API_KEYS", "key=user:tier")


@pytest.mark.parametrize(
    ("role", "setting"), [("relay", "TANDEM_HTTP_PORT"), ("relay", "TANDEM_OPS_PORT"), ("prefill", "TANDEM_GRPC_PORT")]
)
def test_port_in_use_fails_at_start(nats_server, redis_server, role, setting):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        result = _start_failing(role, nats_server.url, redis_server.url, **{setting: str(port)})
    _one_clear_line(result, role, f"port {port} on 127.0.0.1 is in use", setting)


def test_missing_model_fails_at_start(nats_server, redis_server, tmp_path):
    result = _start_failing("decode", nats_server.url, redis_server.url, TANDEM_MODEL_PATH=str(tmp_path / "gone.gguf"))
    _one_clear_line(result, "decode", "TANDEM_MODEL_PATH=", "no such file")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_fails_at_start(nats_server, redis_server):
    result = _start_failing("prefill", nats_server.url, redis_server.url, TANDEM_DEVICE="cuda")
    _one_clear_line(result, "prefill", "TANDEM_DEVICE=cuda", "sees no CUDA GPU here")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_on_a_reachable_host_without_an_internal_secret_fails_at_start(nats_server, redis_server, role):
    """It stops before it listens on anything: its gRPC port would take Drain and KV reservations from anyone."""
    result = _start_failing(role, nats_server.url, redis_server.url, TANDEM_HOST="0.0.0.0", TANDEM_INTERNAL_SECRET="")
    _one_clear_line(result, role, "TANDEM_HOST is '0.0.0.0'", "TANDEM_INTERNAL_SECRET is empty", "TANDEM_ALLOW_INSECURE_INTERNAL=1")
