"""Containers' bus identities (compose, Kubernetes): nats-server maps each client's certificate to
its instance's user (tandem.bus.permissions' mapped_tls_config and cert_mapped_users, the way
deploy/nats/nats.conf and deploy/helm/nats-values.yaml are rendered). Against a real server, a
client showing decode-0's certificate takes decode-0's assignments and is refused decode-1's and
another role's inbox, and may not publish decode-1's heartbeat; a certificate of the same CA
that names no user (a role's, as every container had before) is refused outright, whatever
password it sends. Refusals are proved as in test_bus_instance_identities: the server reports
each, and a control message sent after the forbidden one arrives while the forbidden one does not."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from tandem.bus import subjects
from tandem.bus.permissions import OPERATOR, Identity, cert_mapped_users, inbox_prefix, mapped_tls_config, render_config
from tandem.devstack.certs import CertSet, make_cert_set
from tandem.devstack.proc import ChildProcess
from tandem.devstack.servers import READY_TIMEOUT_S, nats_server_binary
from tandem.tls import nats_tls_options

WAIT_S = 10.0
DECODE_0, DECODE_1, RELAY_0 = Identity("decode", "decode-0"), Identity("decode", "decode-1"), Identity("relay", "relay-0")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_cert_set(
        tmp_path_factory.mktemp("mapped-tls"), services=("nats", OPERATOR, "decode"), instances=[DECODE_0, DECODE_1, RELAY_0]
    )


@pytest.fixture(scope="module")
def server(certs: CertSet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChildProcess]:
    folder: Path = tmp_path_factory.mktemp("mapped-nats")
    config = folder / "nats.conf"
    config.write_text(mapped_tls_config(str(certs.folder)) + render_config(cert_mapped_users([DECODE_0, DECODE_1, RELAY_0])))
    argv = [nats_server_binary(), "-c", str(config), "-js", "-sd", str(folder / "store"), "-a", "127.0.0.1", "-p", "-1"]
    child = ChildProcess("nats", argv)
    child.start()
    yield child
    child.stop()


@pytest.fixture(scope="module")
def address(server: ChildProcess) -> str:
    listening = server.wait_for_line(r"Listening for client connections on ([\d.]+):(\d+)", READY_TIMEOUT_S)
    assert listening is not None, server.recent_output()
    return f"nats://{listening[1]}:{listening[2]}"


async def _connect(address: str, certs: CertSet, holder: str, inbox: str, **login: str) -> tuple[Client, asyncio.Queue[Exception]]:
    """A client showing `holder`'s certificate, and the refusals the server reports to it."""
    refusals: asyncio.Queue[Exception] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        refusals.put_nowait(exc)

    client = await nats.connect(
        address,
        **nats_tls_options(certs.settings(holder)),
        inbox_prefix=inbox,
        error_cb=on_error,
        allow_reconnect=False,
        max_reconnect_attempts=0,
        connect_timeout=WAIT_S,
        **login,  # type: ignore[arg-type]
    )
    return client, refusals


async def _refused(refusals: asyncio.Queue[Exception], subject: str) -> None:
    exc = await asyncio.wait_for(refusals.get(), WAIT_S)
    assert subject.lower() in str(exc).lower(), f"refused something else than {subject}: {exc}"


async def _arrival(queue: asyncio.Queue[Msg], server: ChildProcess, refusals: asyncio.Queue[Exception], *clients: Client) -> Msg:
    """The next message in `queue`; past WAIT_S, a failure that says what the clients and the
    server were doing (connected, their last error, refusals not yet read, the server's log)."""
    try:
        return await asyncio.wait_for(queue.get(), WAIT_S)
    except TimeoutError:
        states = [(client.is_connected, client.last_error) for client in clients]
        pending = [refusals.get_nowait() for _ in range(refusals.qsize())]
        raise AssertionError(f"nothing in {WAIT_S} s; clients {states}, refusals {pending}; server:\n{server.recent_output(40)}") from None


def _collect(into: asyncio.Queue[Msg]):
    async def on_message(msg: Msg) -> None:
        into.put_nowait(msg)

    return on_message


async def test_decode_0s_certificate_takes_its_own_assignments_and_not_decode_1s_nor_the_relays_inbox(
    address: str, certs: CertSet, server: ChildProcess
):
    operator, _ = await _connect(address, certs, OPERATOR, "_INBOX.operator")
    worker, refusals = await _connect(address, certs, "decode-0", inbox_prefix("decode", "decode-0"))
    try:
        theirs: asyncio.Queue[Msg] = asyncio.Queue()
        mine: asyncio.Queue[Msg] = asyncio.Queue()
        relay_inbox = f"{inbox_prefix('relay', 'relay-0')}.>"
        await worker.subscribe(subjects.assign("decode-1"), cb=_collect(theirs))
        await _refused(refusals, subjects.assign("decode-1"))
        await worker.subscribe(relay_inbox, cb=_collect(theirs))
        await _refused(refusals, relay_inbox)
        await worker.subscribe(subjects.assign("decode-0"), cb=_collect(mine))
        await worker.flush()
        await operator.publish(subjects.assign("decode-1"), b"another worker's prompt")
        await operator.publish(relay_inbox.replace(">", "tokens"), b"a user's reply")
        await operator.publish(subjects.assign("decode-0"), b"control")
        await operator.flush()
        assert (await _arrival(mine, server, refusals, worker, operator)).data == b"control"
        assert theirs.empty(), "sent before the control message, they would have arrived first"
    finally:
        await worker.close()
        await operator.close()


async def test_decode_0s_certificate_may_not_publish_decode_1s_heartbeat(address: str, certs: CertSet, server: ChildProcess):
    operator, _ = await _connect(address, certs, OPERATOR, "_INBOX.operator")
    worker, refusals = await _connect(address, certs, "decode-0", inbox_prefix("decode", "decode-0"))
    try:
        arrived: asyncio.Queue[Msg] = asyncio.Queue()
        await operator.subscribe(subjects.heartbeats_of("decode"), cb=_collect(arrived))
        await operator.flush()
        await worker.publish(subjects.heartbeat("decode", "decode-1"), b"dial me instead")
        await worker.publish(subjects.heartbeat("decode", "decode-0"), b"control")
        await worker.flush()
        await _refused(refusals, subjects.heartbeat("decode", "decode-1"))
        first = await _arrival(arrived, server, refusals, worker, operator)
        assert (first.subject, first.data) == (subjects.heartbeat("decode", "decode-0"), b"control")
    finally:
        await worker.close()
        await operator.close()


@pytest.mark.parametrize("login", [{}, {"user": "decode-0.decode.tandem.internal"}, {"user": OPERATOR, "password": "anything"}])
async def test_a_certificate_of_the_ca_that_names_no_user_is_refused(address: str, certs: CertSet, login: dict[str, str]):
    """The role certificate names decode and decode.tandem.internal, no instance: no user of the
    server, and the user or password it sends is not looked at."""
    with pytest.raises(nats.errors.Error, match="(?i)authorization"):
        await _connect(address, certs, "decode", inbox_prefix("decode", "decode-0"), **login)


async def test_decode_0s_certificate_looks_the_stream_up_and_may_not_make_one_which_the_operators_may(address: str, certs: CertSet):
    """A worker's start waits for the token stream through the JetStream API, its answers coming
    to its own inbox; only the operator's certificate makes a stream."""
    worker, refusals = await _connect(address, certs, "decode-0", inbox_prefix("decode", "decode-0"))
    operator, _ = await _connect(address, certs, OPERATOR, "_INBOX.operator")
    try:
        assert (await worker.jetstream(timeout=WAIT_S).account_info()) is not None
        with pytest.raises(nats.errors.TimeoutError):  # refused: no answer comes
            await worker.jetstream(timeout=1).add_stream(name="CERT_MAPPED_WORKER", subjects=["cert.mapped.worker"])
        await _refused(refusals, "$JS.API.STREAM.CREATE.CERT_MAPPED_WORKER")
        made = await operator.jetstream(timeout=WAIT_S).add_stream(name="CERT_MAPPED_OPERATOR", subjects=["cert.mapped.operator"])
        assert made.config.name == "CERT_MAPPED_OPERATOR"
    finally:
        await worker.close()
        await operator.close()
