"""Each service process logs in as its own instance (tandem.devstack.bus_users): against a real
nats-server, a worker's login is refused another worker's assignments, another instance's or
role's inbox, and publishing a heartbeat, KV events or a token batch under another instance id.
Each refusal is proved twice: the server reports it (error_cb), and an operator-side message sent
after the forbidden one arrives while the forbidden one does not."""

from __future__ import annotations

import asyncio
import uuid

import nats
import pytest
from helpers import instance_client
from nats.aio.client import Client
from nats.aio.msg import Msg

from tandem.bus import subjects
from tandem.bus.permissions import inbox_prefix
from tandem.devstack.bus_users import join_local_bus
from tandem.devstack.servers import EmbeddedServer

WAIT_S = 10.0


def _instance(role: str) -> str:
    return f"{role}-ids-{uuid.uuid4().hex[:8]}"


async def _connect_as(nats_server: EmbeddedServer, role: str, instance_id: str) -> tuple[Client, asyncio.Queue[Exception]]:
    """A client with `instance_id`'s own login and inbox, and the refusals the server reports to it."""
    refusals: asyncio.Queue[Exception] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        refusals.put_nowait(exc)

    client = await instance_client(nats_server.url, role, instance_id, on_error)
    return client, refusals


async def _refused(refusals: asyncio.Queue[Exception], subject: str) -> None:
    exc = await asyncio.wait_for(refusals.get(), WAIT_S)
    assert type(exc) is nats.errors.Error, exc  # nats-py reports a refusal as its base type (tandem.bus.connection)
    assert subject.lower() in str(exc).lower(), f"refused something else than {subject}: {exc}"  # nats-py lowercases it


def _collect(into: asyncio.Queue[Msg]):
    async def on_message(msg: Msg) -> None:
        into.put_nowait(msg)

    return on_message


async def test_a_worker_may_take_its_own_assignments_and_not_another_workers(nats_server: EmbeddedServer, nc: Client):
    me, other = _instance("decode"), _instance("decode")
    client, refusals = await _connect_as(nats_server, "decode", me)
    try:
        theirs: asyncio.Queue[Msg] = asyncio.Queue()
        mine: asyncio.Queue[Msg] = asyncio.Queue()
        await client.subscribe(subjects.assign(other), cb=_collect(theirs))
        await _refused(refusals, subjects.assign(other))
        await client.subscribe(subjects.assign(me), cb=_collect(mine))
        await client.flush()
        await nc.publish(subjects.assign(other), b"another worker's prompt")
        await nc.publish(subjects.assign(me), b"control")
        await nc.flush()
        assert (await asyncio.wait_for(mine.get(), WAIT_S)).data == b"control"
        assert theirs.empty(), "sent before the control message, it would have arrived first"
    finally:
        await client.close()


@pytest.mark.parametrize("inbox_of", ["same_role", "other_role", "every"])
async def test_a_worker_may_not_read_another_instances_or_roles_inbox(nats_server: EmbeddedServer, nc: Client, inbox_of: str):
    me = _instance("decode")
    target = {
        "same_role": f"{inbox_prefix('decode', _instance('decode'))}.>",
        "other_role": f"{inbox_prefix('relay', _instance('relay'))}.>",  # where the relay's pulled token events arrive
        "every": "_INBOX.>",
    }[inbox_of]
    client, refusals = await _connect_as(nats_server, "decode", me)
    try:
        stolen: asyncio.Queue[Msg] = asyncio.Queue()
        await client.subscribe(target, cb=_collect(stolen))
        await _refused(refusals, target)

        await nc.publish(target.replace(">", "reply-text"), b"someone else's reply")
        await nc.flush()
        # The control: the server answers a request on the worker's own inbox, after the stolen message.
        assert (await client.jetstream(timeout=WAIT_S).account_info()) is not None
        assert stolen.empty()
    finally:
        await client.close()


async def test_a_worker_publishes_heartbeats_kv_events_and_token_batches_only_under_its_own_id(nats_server: EmbeddedServer, nc: Client):
    me, victim = _instance("prefill"), _instance("prefill")
    spoofed = [subjects.heartbeat("prefill", victim), subjects.kv_events(victim), subjects.token_batch(victim)]
    arrived: asyncio.Queue[Msg] = asyncio.Queue()
    for subject in [*spoofed, subjects.heartbeat("prefill", me)]:
        await nc.subscribe(subject, cb=_collect(arrived))
    await nc.flush()
    client, refusals = await _connect_as(nats_server, "prefill", me)
    try:
        for subject in spoofed:
            await client.publish(subject, b"I am " + victim.encode())
        await client.publish(subjects.heartbeat("prefill", me), b"control")
        await client.flush()
        for subject in spoofed:
            await _refused(refusals, subject)
        first = await asyncio.wait_for(arrived.get(), WAIT_S)
        assert (first.subject, first.data) == (subjects.heartbeat("prefill", me), b"control")
        assert arrived.empty()
    finally:
        await client.close()


async def test_another_instances_password_does_not_log_in(nats_server: EmbeddedServer):
    me, other = _instance("chat"), _instance("chat")
    env = join_local_bus("chat", me, nats_server.url)
    join_local_bus("chat", other, nats_server.url)
    with pytest.raises(nats.errors.Error):
        await nats.connect(env["TANDEM_NATS_URL"], user=other, password=env["TANDEM_NATS_PASSWORD"], allow_reconnect=False)
