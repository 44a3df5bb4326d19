"""The conversation store on real SQLite files and a real Cassandra node.

Cassandra: TANDEM_CASSANDRA_HOSTS names a running cluster (TANDEM_CASSANDRA_USERNAME/_PASSWORD
its admin, TANDEM_CASSANDRA_CA_FILE the CA of its TLS certificate, empty: in clear); otherwise one
node is started per session, which takes TLS clients only (JDK 17 and mvn needed, see
tandem.devstack.cassandra_node). Without them the Cassandra cases are skipped with one line saying
why; TANDEM_REQUIRE_CASSANDRA=1 (CI) makes that a failure. The stores log in as the services do:
as the keyspace's application role, after `tandem store migrate`'s step made the keyspace.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from helpers import cassandra_tools_missing, migrate_cassandra

from tandem.devstack.cassandra_node import NodeConfig, RunningNode, start_node, stop_node
from tandem.store import ConversationStore
from tandem.store.cassandra import CassandraStore
from tandem.store.sqlite import SqliteStore

BUCKET_SIZE = 3  # small, so that every conversation in the suite spans several buckets
TIMEOUT_S = 5.0
_SKIP_PREFIX = "!!! CASSANDRA STORE NOT TESTED: "


def cassandra_missing() -> str | None:
    """Why no node can be started here, or None."""
    return cassandra_tools_missing()


def skip_cassandra(reason: str) -> None:
    if os.environ.get("TANDEM_REQUIRE_CASSANDRA") == "1":
        pytest.fail(f"TANDEM_REQUIRE_CASSANDRA=1 but no Cassandra: {reason}", pytrace=False)
    pytest.skip(f"{_SKIP_PREFIX}{reason} (set TANDEM_CASSANDRA_HOSTS, or install JDK 17 and maven)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Every Cassandra skip reported from one place, so `-ra` folds them into one line."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple) and _SKIP_PREFIX in report.longrepr[2]:
        report.longrepr = (os.path.relpath(__file__, item.config.rootpath), 1, report.longrepr[2])


@pytest.fixture(scope="session")
def cassandra_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The session's cluster: its hosts and the CA its clients verify it with."""
    if os.environ.get("TANDEM_CASSANDRA_HOSTS"):
        yield os.environ["TANDEM_CASSANDRA_HOSTS"], os.environ.get("TANDEM_CASSANDRA_CA_FILE", "")
        return
    if (reason := cassandra_missing()) is not None:
        skip_cassandra(reason)
    started_s = time.monotonic()
    node = start_node(NodeConfig(node_dir=tmp_path_factory.mktemp("cassandra"), is_durable=False))
    print(f"\nCassandra node ready in {time.monotonic() - started_s:.1f} s on {node.hosts}")
    yield node.hosts, node.ca_file
    stop_node(node, kill=True)  # a throwaway node: no drain needed


@pytest.fixture(scope="session")
def cassandra_hosts(cassandra_cluster: tuple[str, str]) -> str:
    return cassandra_cluster[0]


@pytest.fixture(scope="session")
def cassandra_ca_file(cassandra_cluster: tuple[str, str]) -> str:
    return cassandra_cluster[1]


@pytest.fixture
def cassandra_tools() -> None:
    """Skips (or, with TANDEM_REQUIRE_CASSANDRA=1, fails) a test that starts nodes where none can start."""
    if (reason := cassandra_missing()) is not None:
        skip_cassandra(reason)


@pytest.fixture
def own_cassandra_node(tmp_path: Path, cassandra_tools: None) -> Iterator[Callable[..., RunningNode]]:
    """Starts nodes that a test may stop and restart (never the shared one)."""
    nodes: list[RunningNode] = []

    def start(**fields: object) -> RunningNode:
        # No fsync; a killed JVM still keeps what the batch commit log acknowledged.
        nodes.append(start_node(NodeConfig(node_dir=tmp_path / "node", is_durable=False, **fields)))
        return nodes[-1]

    yield start
    for node in nodes:
        if node.is_alive():
            stop_node(node, kill=True)


@pytest.fixture(scope="session")
def bucket_size() -> int:
    return BUCKET_SIZE


@pytest.fixture(scope="session")
def keyspace() -> str:
    return f"test_{uuid.uuid4().hex[:12]}"


@pytest_asyncio.fixture(scope="session")
async def cassandra_login(cassandra_hosts: str, cassandra_ca_file: str, keyspace: str, bucket_size: int) -> dict[str, str]:
    """The session keyspace, migrated; the login of its application role."""
    return await migrate_cassandra(cassandra_hosts, keyspace, bucket_size, ca_file=cassandra_ca_file)


@pytest.fixture(params=["sqlite", "cassandra"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


StoreFactory = Callable[[], Awaitable[ConversationStore]]


@pytest.fixture
def make_client(store_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], ConversationStore]:
    """A new, unstarted client of this test's store: the same SQLite file or Cassandra keyspace."""
    if store_kind == "sqlite":
        return lambda: SqliteStore(tmp_path / "store" / "conversations.db", timeout_s=TIMEOUT_S)
    hosts, keyspace, login = (request.getfixturevalue(name) for name in ("cassandra_hosts", "keyspace", "cassandra_login"))
    return lambda: CassandraStore(hosts, keyspace=keyspace, timeout_s=TIMEOUT_S, bucket_size=BUCKET_SIZE, **login)


@pytest_asyncio.fixture
async def new_store(make_client: Callable[[], ConversationStore]) -> AsyncIterator[StoreFactory]:
    """Opens another started client on each call; all are closed after the test."""
    opened: list[ConversationStore] = []

    async def open_one() -> ConversationStore:
        store = make_client()
        await store.start()
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        await store.close()


@pytest_asyncio.fixture
async def store(new_store: StoreFactory) -> ConversationStore:
    return await new_store()
