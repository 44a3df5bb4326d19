"""The stack's control API that the failure drills use, on the real servers (a stack that runs
no services): a killed server comes back on its port, a restarted Redis keeps what was written
(its append-only file), a held server stays down until released; and neither server takes a
plaintext client."""

from __future__ import annotations

import asyncio
import io
import signal
import socket
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import nats
import nats.errors
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from tandem.config import ApiKey, Tier
from tandem.devstack.members import StackConfig
from tandem.devstack.stack import Console, Stack
from tandem.tls import nats_tls_options

DEADLINE_S = 30.0


@pytest_asyncio.fixture
async def stack() -> AsyncIterator[Stack]:
    config = StackConfig(host="127.0.0.1", chat_port=0, api_keys={"k": ApiKey("u", Tier.PLUS)}, extra_env={}, roles=(), stop_timeout_s=5.0)
    async with Stack(config, Console(io.StringIO())) as running:
        yield running


def address_of(url: str) -> tuple[str, int]:
    parts = urlsplit(url)  # the URL carries a login
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def new_pid(stack: Stack, name: str, old_pid: int) -> int:
    """The member's next process, once its supervisor has started it."""
    async with asyncio.timeout(DEADLINE_S):
        while (pid := stack.member(name).pid) in (None, old_pid):
            await asyncio.sleep(0.05)
    assert pid is not None
    return pid


async def test_a_restarted_redis_keeps_what_was_written_before(stack):
    client = aioredis.from_url(stack.redis_url)
    await client.set("tandem:test:kept", "yes", ex=600)
    old_pid = stack.member("redis").pid
    await stack.restart("redis", timeout_s=DEADLINE_S)
    assert stack.member("redis").pid not in (None, old_pid)
    await client.aclose()
    client = aioredis.from_url(stack.redis_url)  # the old connection died with the old process
    assert await client.get("tandem:test:kept") == b"yes", "the append-only file brought the key back"
    await client.aclose()


async def test_a_killed_server_is_restarted_on_its_port(stack):
    old_pid = stack.send_signal("nats", signal.SIGKILL)
    await new_pid(stack, "nats", old_pid)
    await stack.wait_ready("nats", DEADLINE_S)
    client = await nats.connect(stack.nats_url, **nats_tls_options(stack.operator_tls), connect_timeout=2, max_reconnect_attempts=0)
    assert client.is_connected
    await client.close()


async def test_a_held_server_stays_down_until_released(stack):
    await stack.hold("nats")
    assert stack.member("nats").pid is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address_of(stack.nats_url), timeout=2).close()
    assert stack.member("nats").pid is None, "the supervisor left it down"
    await stack.release("nats", DEADLINE_S)
    client = await nats.connect(stack.nats_url, **nats_tls_options(stack.operator_tls), connect_timeout=2, max_reconnect_attempts=0)
    await client.close()


async def test_a_stopped_process_keeps_its_pid_and_continues(stack):
    pid = stack.send_signal("redis", signal.SIGSTOP)
    client = aioredis.from_url(stack.redis_url, socket_timeout=0.5)
    with pytest.raises(aioredis.TimeoutError):
        await client.ping()
    stack.send_signal("redis", signal.SIGCONT)
    assert stack.member("redis").pid == pid
    fresh = aioredis.from_url(stack.redis_url, socket_timeout=5)
    assert await fresh.ping()
    await client.aclose()
    await fresh.aclose()


async def test_the_stacks_servers_take_no_plaintext_client(stack):
    """What `tandem up` starts, as it starts it: its NATS requires TLS, and its Redis has no
    plaintext TCP port (a TLS one, or only a unix socket: tandem.devstack.redis_listen)."""
    with pytest.raises((ssl.SSLError, nats.errors.Error, OSError)):  # no TLS options: no certificate of the stack's CA
        plain = await nats.connect(stack.nats_url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)
        await plain.close()
    assert urlsplit(stack.redis_url).scheme in ("rediss", "unix")
    client = aioredis.from_url(stack.redis_url, socket_timeout=5)
    assert await client.config_get("port") == {"port": "0"}
    await client.aclose()
