"""The routes between NATS nodes under `tandem up --ha` are TLS, verified both ways, on real
nats-server nodes with the certificates `tandem up` makes: the cluster forms over them (a message
published on one node reaches a subscriber on another), and a route dialer that speaks plaintext,
or shows a certificate of another CA, is cut off before it is a route (a route port speaks TLS
first, before its INFO)."""

from __future__ import annotations

import socket
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from helpers import wait_until

from tandem.devstack.certs import CertSet, make_cert_set
from tandem.devstack.servers import NatsCluster, NatsNode, plan_nats_cluster, start_nats_cluster
from tandem.tls import nats_tls_options

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_cert_set(tmp_path_factory.mktemp("route-tls"), services=("nats", "operator"))


@pytest.fixture(scope="module")
def nodes() -> list[NatsNode]:
    return plan_nats_cluster(3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, certs: CertSet, nodes: list[NatsNode]) -> Iterator[NatsCluster]:
    started = start_nats_cluster(tmp_path_factory.mktemp("route-tls-cluster"), nodes=nodes, certs=certs)
    yield started
    started.stop()


def _answer_to_ping(sock: socket.socket | ssl.SSLSocket) -> bytes:
    """Sends a route's CONNECT and a PING and reads what comes back until the server closes the
    connection or answers PONG (b"" or the bytes read); the socket's timeout is the deadline."""
    sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"cluster":"tandem-local"}\r\nPING\r\n')
    received = b""
    try:
        while b"PONG" not in received:
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
    except (ConnectionResetError, ssl.SSLError):
        pass
    return received


async def test_a_message_crosses_the_tls_routes(cluster: NatsCluster, certs: CertSet) -> None:
    tls = nats_tls_options(certs.settings("operator"))
    first = await nats.connect(cluster.nodes[0].url, connect_timeout=TIMEOUT_S, allow_reconnect=False, **tls)
    last = await nats.connect(cluster.nodes[-1].url, connect_timeout=TIMEOUT_S, allow_reconnect=False, **tls)
    subject = f"route-tls.{uuid.uuid4().hex}"
    received = await last.subscribe(subject)
    await last.flush()

    async def crossed() -> bool:
        await first.publish(subject, b"over the route")  # again until the subscription's interest reached node 0
        await first.flush()
        try:
            return (await received.next_msg(timeout=0.2)).data == b"over the route"
        except nats.errors.TimeoutError:
            return False

    try:
        await wait_until(crossed, timeout_s=TIMEOUT_S)
    finally:
        await first.close()
        await last.close()


def test_a_plaintext_route_is_cut_off(cluster: NatsCluster, nodes: list[NatsNode]) -> None:
    with socket.create_connection((nodes[1].host, nodes[1].cluster_port), timeout=TIMEOUT_S) as sock:
        assert _answer_to_ping(sock) == b"", "not even the INFO a route port sends once TLS is up"


def test_a_route_with_a_certificate_of_another_ca_is_cut_off(
    cluster: NatsCluster, nodes: list[NatsNode], certs: CertSet, tmp_path: Path
) -> None:
    strangers = make_cert_set(tmp_path, services=("nats",))
    for holder, is_let_in in ((certs, True), (strangers, False)):  # ours first: the same steps do get a PONG
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(certs.ca_file))
        context.load_cert_chain(holder.cert_file("nats"), holder.key_file("nats"))
        with socket.create_connection((nodes[1].host, nodes[1].cluster_port), timeout=TIMEOUT_S) as sock:
            try:
                with context.wrap_socket(sock, server_hostname=nodes[1].host) as tls:
                    answer = _answer_to_ping(tls)
            except ssl.SSLError:
                answer = b""  # TLS 1.2: the server's alert ends the handshake itself
        assert (b"PONG" in answer) is is_let_in, (holder.folder, answer)
