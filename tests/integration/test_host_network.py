"""Hosts of their own (tandem.devstack.hosts), tried with real processes in real network
namespaces: a server on one host answers a client on another and on the machine itself; a cut
host answers nobody until healed; two separated hosts cannot reach each other while each still
reaches a third; and closing the network leaves no namespace or link behind. Needs root, as the
partition drills do."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from tandem.devstack.hosts import Host, HostNetwork, can_make_hosts

pytestmark = pytest.mark.skipif(bool(can_make_hosts()), reason=can_make_hosts() or "root")

PORT = 7000
SERVER = textwrap.dedent(
    """
    import socket, sys
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    while True:
        connection, _ = server.accept()
        connection.sendall(b"hello from " + sys.argv[1].encode())
        connection.close()
    """
)
CLIENT = textwrap.dedent(
    """
    import socket, sys
    try:
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5) as connection:
            print(connection.recv(100).decode())
    except OSError as exc:
        print(type(exc).__name__)
    """
)


@pytest.fixture
def network() -> Iterator[HostNetwork]:
    with HostNetwork() as network:
        yield network


def serve(host: Host) -> subprocess.Popen[str]:
    server = subprocess.Popen([*host.prefix, sys.executable, "-c", SERVER, host.address, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"
    return server


def reach(target: Host, source: Host | None = None) -> str:
    """What a client on `source` (None: the machine itself) gets from the server on `target`."""
    prefix = [] if source is None else source.prefix
    argv = [*prefix, sys.executable, "-c", CLIENT, target.address, str(PORT)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True).stdout.strip()


def test_hosts_reach_each_other_until_cut_or_separated(network: HostNetwork) -> None:
    one, other, third = network.add("one"), network.add("other"), network.add("third")
    assert len({one.address, other.address, third.address, network.gateway}) == 4
    servers = [serve(host) for host in (one, other)]
    try:
        hello = f"hello from {one.address}"
        assert reach(one, other) == hello and reach(one) == hello
        network.cut(one)
        assert reach(one, other) == "TimeoutError" and reach(one) == "TimeoutError"
        network.heal(one)
        assert reach(one, other) == hello
        network.separate(one, other)
        assert reach(one, other) == "TimeoutError" and reach(other, one) == "TimeoutError"
        assert reach(one, third) == hello and reach(other, third) == f"hello from {other.address}"
        network.join(one, other)
        assert reach(one, other) == hello
    finally:
        for server in servers:
            server.kill()
            server.wait(timeout=10)


def test_closing_leaves_nothing_behind() -> None:
    network = HostNetwork()
    host = network.add("lonely")
    network.close()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert host.namespace not in namespaces
    assert network.bridge not in links and host.port_device not in links
