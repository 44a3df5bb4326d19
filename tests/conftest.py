"""Session-wide real servers (nats-server with JetStream, redis-server) and a NATS client.

Nothing here is mocked: the fixtures start the same binaries `tandem up` starts, with the same
logins (one set for the session's servers, in their work folder): a server's `.url` carries the
operator's login (NATS) or the password (Redis), so `nc` and test code connect as a tool does;
tests/helpers.py's service_env gives each service process its own role's login.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from tandem.devstack.servers import EmbeddedServer, start_nats, start_redis


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
