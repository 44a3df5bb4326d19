"""TLS on the internal links, tried against real servers with the certificates `tandem up` makes
(tandem.devstack.certs): NATS with TLS required takes only a client that speaks TLS, trusts our CA
and shows a certificate of it; a worker's gRPC port is mutual TLS and refuses a plaintext
channel, a channel without a client certificate, and one that finds a certificate of another
service where it expected the decode worker's; and each of its services takes only the roles
that call it (KvHandoff: prefill workers; WorkerControl: the operator and routers)."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import nats
import nats.errors
import pytest
import pytest_asyncio
from cryptography import x509

from tandem.bus.permissions import OPERATOR, Identity
from tandem.devstack.certs import SERVICES, CertSet, make_cert_set
from tandem.devstack.proc import free_port
from tandem.devstack.servers import EmbeddedServer, start_nats
from tandem.runtime import Runtime, RuntimeConfig
from tandem.tls import TlsSettings, nats_tls_options
from tandem.v1 import control_pb2, control_pb2_grpc
from tandem.v1.kv_handoff_pb2 import ReleaseRequest
from tandem.v1.kv_handoff_pb2_grpc import KvHandoffServicer, KvHandoffStub, add_KvHandoffServicer_to_server
from tandem.worker.control import ControlServer, WorkerControl
from tandem.worker.heartbeat import WorkerHeartbeats
from tandem.worker.internal_grpc import internal_channel

SECRET = "internal-tls-test-secret"
TIMEOUT_S = 10.0


INSTANCES = (Identity("prefill", "prefill-0"), Identity("decode", "decode-0"))  # containers' certificates


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_cert_set(tmp_path_factory.mktemp("tls"), instances=INSTANCES)


@pytest.fixture(scope="module")
def strangers(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    """A set of another CA: every name right, nothing trusted."""
    return make_cert_set(tmp_path_factory.mktemp("other-ca"))


@pytest.fixture(scope="module")
def tls_nats(tmp_path_factory: pytest.TempPathFactory, certs: CertSet) -> Iterator[EmbeddedServer]:
    server = start_nats(tmp_path_factory.mktemp("tls-nats"), certs=certs)
    yield server
    server.stop()


def test_the_ca_key_is_never_written_and_each_certificate_names_its_service(certs: CertSet):
    assert {path.name for path in certs.folder.glob("*.key")} == {f"{holder}.key" for holder in [*SERVICES, "prefill-0", "decode-0"]}
    decode = x509.load_pem_x509_certificate(certs.cert_file("decode").read_bytes())
    names = decode.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == ["decode", "decode.tandem.internal", "localhost"]
    assert certs.key_file("decode").stat().st_mode & 0o077 == 0


def _answer_to_plaintext(address: str, password: str) -> bytes:
    """What the server sends a client that logs in (rightly) without TLS, until it closes the connection."""
    host, port = address.removeprefix("nats://").split(":")
    connect = json.dumps({"verbose": False, "user": OPERATOR, "pass": password})
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as plain:
        info = plain.recv(4096)
        assert b'"tls_required":true' in info
        plain.sendall(f"CONNECT {connect}\r\nPING\r\n".encode())
        answer = b""
        while chunk := plain.recv(4096):  # the socket's timeout bounds each read
            answer += chunk
        return answer


def test_nats_closes_a_plaintext_client_without_answering_it(tls_nats: EmbeddedServer):
    assert b"PONG" not in _answer_to_plaintext(tls_nats.address, tls_nats.secrets.operator_password)


async def test_nats_takes_a_client_with_a_certificate_of_its_ca(tls_nats: EmbeddedServer):
    client = await nats.connect(tls_nats.url, **nats_tls_options(tls_nats.tls), connect_timeout=TIMEOUT_S, allow_reconnect=False)
    try:
        assert client.is_connected
        await client.flush(timeout=TIMEOUT_S)
    finally:
        await client.close()


@pytest.mark.parametrize("who", ["no TLS", "another CA", "no client certificate"])
async def test_nats_refuses_a_client_that_cannot_show_our_ca(tls_nats: EmbeddedServer, certs: CertSet, strangers: CertSet, who: str):
    tls = {
        "no TLS": None,  # nats-py then tries the system's roots, which do not know our CA
        "another CA": strangers.settings("operator"),
        "no client certificate": TlsSettings(ca_file=str(certs.ca_file)),
    }[who]
    with pytest.raises((ssl.SSLError, nats.errors.Error, OSError)):
        client = await nats.connect(
            tls_nats.url, **nats_tls_options(tls), connect_timeout=TIMEOUT_S, allow_reconnect=False, max_reconnect_attempts=0
        )
        try:
            await client.flush(timeout=TIMEOUT_S)  # TLS 1.3: a missing client certificate shows on the first read
        finally:
            await client.close()


@pytest_asyncio.fixture(scope="module")
async def worker_port(certs: CertSet) -> AsyncIterator[str]:
    """A worker's control server with the decode worker's certificate (its runtime never connects:
    Health answers NOT_SERVING, which is an answer), and KvHandoff's generated base servicer,
    whose every method answers UNIMPLEMENTED once a call gets that far."""
    address = f"127.0.0.1:{free_port()}"
    runtime = Runtime(RuntimeConfig("decode", "decode-tls", "http://127.0.0.1:1", "nats://127.0.0.1:1", None, 1.0))
    heartbeats = WorkerHeartbeats("m", address, lambda: None, lambda: ())
    server = ControlServer(WorkerControl(runtime, heartbeats), address, SECRET, tls=certs.settings("decode"))
    server.add_service(lambda grpc_server: add_KvHandoffServicer_to_server(KvHandoffServicer(), grpc_server))
    await server.start()
    yield address
    await server.stop()


async def _health(channel: grpc.aio.Channel) -> control_pb2.HealthReply:
    return await control_pb2_grpc.WorkerControlStub(channel).Health(control_pb2.HealthRequest(), timeout=TIMEOUT_S)


async def test_a_workers_grpc_port_serves_a_mutual_tls_channel_with_the_secret(worker_port: str, certs: CertSet):
    async with internal_channel(worker_port, SECRET, certs.settings("operator"), peer_role="decode") as channel:
        assert (await _health(channel)).status in (control_pb2.HealthReply.STATUS_SERVING, control_pb2.HealthReply.STATUS_NOT_SERVING)


@pytest.mark.parametrize(
    ("caller", "service", "expected"),
    [
        ("prefill", "KvHandoff", grpc.StatusCode.UNIMPLEMENTED),  # let through, to the bare servicer
        ("decode", "KvHandoff", grpc.StatusCode.PERMISSION_DENIED),  # another worker may not reserve its blocks
        ("chat", "KvHandoff", grpc.StatusCode.PERMISSION_DENIED),
        ("prefill", "WorkerControl", grpc.StatusCode.PERMISSION_DENIED),  # nor drain it
        ("prefill-0", "KvHandoff", grpc.StatusCode.UNIMPLEMENTED),  # an instance's certificate names its role too
        ("decode-0", "KvHandoff", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
async def test_each_service_takes_only_the_certificates_of_the_roles_that_call_it(
    worker_port: str, certs: CertSet, caller: str, service: str, expected: grpc.StatusCode
):
    async with internal_channel(worker_port, SECRET, certs.settings(caller), peer_role="decode") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            if service == "KvHandoff":
                await KvHandoffStub(channel).Release(ReleaseRequest(reply_id="reply-x"), timeout=TIMEOUT_S)
            else:
                await control_pb2_grpc.WorkerControlStub(channel).Drain(control_pb2.DrainRequest(), timeout=TIMEOUT_S)
    assert refused.value.code() == expected


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "another CA", "expects another service"])
async def test_a_workers_grpc_port_refuses_a_channel_without_mutual_tls_of_its_ca(
    worker_port: str, certs: CertSet, strangers: CertSet, tmp_path: Path, who: str
):
    if who == "plaintext":
        channel = internal_channel(worker_port, SECRET)
    elif who == "no client certificate":
        credentials = grpc.ssl_channel_credentials(root_certificates=certs.ca_file.read_bytes())
        options = [("grpc.ssl_target_name_override", "decode.tandem.internal")]
        channel = grpc.aio.secure_channel(worker_port, credentials, options=options)
    elif who == "another CA":
        channel = internal_channel(worker_port, SECRET, strangers.settings("prefill"), peer_role="decode")
    else:  # the address of a decode worker, as a spoofed heartbeat would give, answered by a router's certificate
        channel = internal_channel(worker_port, SECRET, certs.settings("prefill"), peer_role="router")
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _health(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
