"""The test tiers, and session-wide real servers (nats-server with JetStream, redis-server) and a
NATS client.

Tiers: a test's folder under tests/ is its tier and its marker (unit, integration, e2e, bench), and
a run goes through them in that order, however it was started, so a broken unit shows in seconds
and not after the stacks (`pytest -m unit`, or `make test-unit`, runs one tier).

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

from tandem.devstack.servers import EmbeddedServer, init_token_stream, start_nats, start_redis

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "e2e", "bench")


def tier_of(item: pytest.Item) -> str:
    tier = item.path.relative_to(TESTS).parts[0]
    if tier not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{{{','.join(TIERS)}}}/, its tier")
    return tier


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A stable sort: within a tier, modules (and their module-scoped fixtures) keep pytest's order.
    for item in items:
        item.add_marker(tier_of(item))
    items.sort(key=lambda item: TIERS.index(tier_of(item)))


@pytest.fixture(scope="session")
def servers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def nats_server(servers_dir: Path) -> Iterator[EmbeddedServer]:
    server = start_nats(servers_dir)
    init_token_stream(server)  # the admin step: services only wait for the stream
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
