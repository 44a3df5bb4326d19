"""The Cassandra launcher: JDK 17 only, refuses taken ports, and `tandem cassandra up|status|down`."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tandem.devstack.cassandra_node import SUPERUSER, NodeConfig, find_java17, java_major_version, read_state, start_node
from tandem.errors import StartupError
from tandem.store import Conversation
from tandem.store.cassandra import CassandraStore
from tandem.store.cassandra_roles import APP_ROLE


def tandem(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=300, env=os.environ | (env or {})
    )


def test_a_java_other_than_17_is_refused() -> None:
    others = [str(p) for p in Path("/usr/lib/jvm").glob("*/bin/java") if java_major_version(str(p)) not in (None, 17)]
    if not others:
        pytest.skip("no JDK other than 17 in /usr/lib/jvm to refuse")
    with pytest.raises(StartupError, match="is not a Java 17"):
        find_java17(others[0])


@pytest.mark.usefixtures("cassandra_tools")
def test_a_taken_port_is_refused_before_java_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=f"127.0.0.1:{port} is already taken"):
            start_node(NodeConfig(node_dir=tmp_path / "node", native_port=port))
    assert not (tmp_path / "node" / "logs" / "stdout.log").exists()


def test_status_without_a_node_exits_1(tmp_path: Path) -> None:
    status = tandem("cassandra", "status", "--dir", str(tmp_path))
    assert (status.returncode, status.stdout.strip()) == (1, f"not running (from {tmp_path})")


@pytest.mark.usefixtures("cassandra_tools")
async def test_up_starts_a_node_that_outlives_the_command_and_down_stops_it(tmp_path: Path) -> None:
    node_dir = tmp_path / "node"
    up = tandem("cassandra", "up", "--dir", str(node_dir), "--port", "0", "--heap-mib", "384")
    try:
        assert up.returncode == 0, up.stderr
        hosts = re.search(r"TANDEM_CASSANDRA_HOSTS=(\S+)", up.stdout)[1]
        ca_file = re.search(r"TANDEM_CASSANDRA_CA_FILE=(\S+)", up.stdout)[1]
        assert tandem("cassandra", "status", "--dir", str(node_dir)).returncode == 0
        admin, app = {"TANDEM_CASSANDRA_USERNAME": SUPERUSER[0], "TANDEM_CASSANDRA_PASSWORD": SUPERUSER[1]}, "an app password"
        migrate = tandem(
            "store",
            "migrate",
            env={"TANDEM_STORE": "cassandra", "TANDEM_CASSANDRA_HOSTS": hosts, "TANDEM_CASSANDRA_KEYSPACE": "cli_node"}
            | {"TANDEM_CASSANDRA_CA_FILE": ca_file}
            | admin
            | {"TANDEM_CASSANDRA_APP_PASSWORD": app},
        )
        assert migrate.returncode == 0, migrate.stderr
        assert "keyspace cli_node at schema version" in migrate.stdout
        store = CassandraStore(hosts, keyspace="cli_node", username=APP_ROLE, password=app, ca_file=ca_file)
        await store.start()
        conversation = Conversation(id=f"conv-{uuid.uuid4().hex}", user_id="u", title="t", model="m", created_at_ms=1, updated_at_ms=1)
        assert await store.create_conversation(conversation) == conversation
        await store.close()
        node = read_state(node_dir)
    finally:
        down = tandem("cassandra", "down", "--dir", str(node_dir), "--wipe")
    assert down.returncode == 0, down.stderr
    assert not node.is_alive()
    assert not node_dir.exists()
    assert tandem("cassandra", "status", "--dir", str(node_dir)).returncode == 1
