"""tandem.bus.Bus logs in as its instance's user: the server refuses what the role may not do, and
the Bus says so in the log as an error and stays connected; a wrong password is refused at
connect, logged, and retried rather than crashing the process."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from helpers import wait_until

from tandem.bus import Bus, BusConfig, subjects
from tandem.devstack.bus_users import join_local_bus
from tandem.devstack.secrets import login_of
from tandem.devstack.servers import EmbeddedServer


async def _until_logged(caplog: pytest.LogCaptureFixture, text: str, num_times: int = 1) -> list[str]:
    """The error records holding `text`, once there are `num_times` of them."""

    async def found() -> list[str] | None:
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and text in r.getMessage()]
        return errors if len(errors) >= num_times else None

    return await wait_until(found, timeout_s=10)


async def test_a_publish_outside_the_roles_rights_is_logged_as_refused_and_the_bus_stays_up(
    nats_server: EmbeddedServer, caplog: pytest.LogCaptureFixture
):
    env = join_local_bus("chat", "chat-login", nats_server.url)
    bus = Bus(BusConfig(url=env["TANDEM_NATS_URL"], name="chat-login", user="chat-login", password=env["TANDEM_NATS_PASSWORD"]))
    operator = await nats.connect(nats_server.url)
    generate_requests: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_generate(msg: nats.aio.msg.Msg) -> None:
        generate_requests.put_nowait(msg.data)

    await operator.subscribe(subjects.GENERATE, cb=on_generate)
    await operator.flush()
    bus.start()
    try:
        client = await asyncio.wait_for(bus.wait_connected(), 30)
        with caplog.at_level(logging.ERROR, logger="tandem.bus.connection"):
            await client.publish(subjects.tokens("not-chats-to-write"), b"x")
            await client.flush()
            refused = await _until_logged(caplog, "NATS refused user 'chat-login'")
        assert subjects.tokens("not-chats-to-write") in refused[0]
        assert bus.is_connected
        await client.publish(subjects.GENERATE, b"allowed")  # what chat may do still goes through
        assert await asyncio.wait_for(generate_requests.get(), 10) == b"allowed"
    finally:
        await bus.close()
        await operator.close()


async def test_a_wrong_password_is_logged_as_refused_and_retried(nats_server: EmbeddedServer, caplog: pytest.LogCaptureFixture):
    address = login_of(nats_server.url)[0]
    bus = Bus(BusConfig(url=address, name="wrong", user="chat", password="not-its-password", first_retry_s=0.05, max_retry_s=0.1))
    with caplog.at_level(logging.ERROR, logger="tandem.bus.connection"):
        bus.start()
        try:
            refusals = await _until_logged(caplog, "NATS refused user 'chat'", num_times=2)  # and again
            assert "Authorization Violation" in refusals[0]
            assert not bus.is_connected
            assert "not-its-password" not in " ".join(refusals), "a password never reaches the log"
        finally:
            await bus.close()
