"""Session-wide real servers (nats-server with JetStream, redis-server) and service processes.

Nothing here is mocked: the fixtures start the same binaries `tandem up` starts.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from tandem.bus import decode, subjects
from tandem.proc import ChildProcess, free_port
from tandem.servers import EmbeddedServer, start_nats, start_redis
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat

REPO = Path(__file__).resolve().parent.parent
WORKER_ROLES = ("prefill", "decode")


@pytest.fixture(scope="session")
def servers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def nats_server(servers_dir: Path) -> Iterator[EmbeddedServer]:
    server = start_nats(servers_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(servers_dir: Path) -> Iterator[EmbeddedServer]:
    server = start_redis(servers_dir)
    yield server
    server.stop()


@pytest_asyncio.fixture
async def nc(nats_server: EmbeddedServer) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


def service_env(role: str, nats_url: str, redis_url: str, **extra: str) -> dict[str, str]:
    """Environment for one service process on free ports, with fast heartbeats."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(
        PYTHONUNBUFFERED="1",
        TANDEM_NATS_URL=nats_url,
        TANDEM_REDIS_URL=redis_url,
        TANDEM_HTTP_PORT=str(free_port()),
        TANDEM_INSTANCE_ID=f"{role}-test-{free_port()}",
        TANDEM_HEARTBEAT_INTERVAL_S="0.2",
        TANDEM_API_KEYS="test-key=tester:plus",
    )
    if role in WORKER_ROLES:
        env["TANDEM_GRPC_PORT"] = str(free_port())
    env.update(extra)
    return env


def service_process(role: str, env: dict[str, str]) -> ChildProcess:
    return ChildProcess(role, [sys.executable, "-m", f"services.{role}"], env=env, cwd=str(REPO))


async def next_heartbeat(
    nc: Client, role: str, instance_id: str, accept: Callable[[ServiceHeartbeat], bool] = lambda hb: True, timeout_s: float = 60
) -> ServiceHeartbeat | WorkerHeartbeat:
    """The next heartbeat of one instance that `accept` likes (workers send WorkerHeartbeat)."""
    message_type = WorkerHeartbeat if role in WORKER_ROLES else ServiceHeartbeat
    found: asyncio.Future[ServiceHeartbeat | WorkerHeartbeat] = asyncio.get_running_loop().create_future()

    async def on_message(msg: nats.aio.msg.Msg) -> None:
        heartbeat = decode(msg.data, message_type)
        service = heartbeat.service if isinstance(heartbeat, WorkerHeartbeat) else heartbeat
        if accept(service) and not found.done():
            found.set_result(heartbeat)

    subscription = await nc.subscribe(subjects.heartbeat(role, instance_id), cb=on_message)
    try:
        return await asyncio.wait_for(found, timeout_s)
    finally:
        await subscription.unsubscribe()
