"""The NATS helper against a real nats-server: it waits for a server that comes up late, and
drains on close so nothing published is lost."""

import asyncio

import nats

from tandem.bus import Bus, BusConfig
from tandem.devstack.proc import free_port
from tandem.devstack.secrets import load_or_create
from tandem.devstack.servers import EmbeddedServer, start_nats


async def test_connects_once_a_late_server_comes_up(tmp_path):
    port = free_port()
    operator_password = load_or_create(tmp_path).operator_password  # the login the server will take
    url = f"nats://127.0.0.1:{port}"
    bus = Bus(BusConfig(url=url, name="late", first_retry_s=0.05, max_retry_s=0.2, user="operator", password=operator_password))
    bus.start()
    assert not bus.is_connected
    server = await asyncio.to_thread(start_nats, tmp_path, None, port)
    try:
        client = await asyncio.wait_for(bus.wait_connected(), timeout=30)
        assert client.is_connected
    finally:
        await bus.close()
        server.stop()


async def test_close_drains_pending_publishes(nats_server: EmbeddedServer):
    received: list[bytes] = []
    done = asyncio.Event()
    reader = await nats.connect(nats_server.url)

    async def on_message(msg):
        received.append(msg.data)
        if len(received) == 500:
            done.set()

    await reader.subscribe("drain.test", cb=on_message)
    await reader.flush()
    bus = Bus(BusConfig(url=nats_server.url, name="writer"))
    bus.start()
    client = await bus.wait_connected()
    for i in range(500):
        await client.publish("drain.test", str(i).encode())
    await bus.close()  # no flush of our own: close must deliver them
    await asyncio.wait_for(done.wait(), timeout=30)
    assert received == [str(i).encode() for i in range(500)]
    await reader.close()


async def test_on_connect_runs_after_connecting(nats_server: EmbeddedServer):
    bus = Bus(BusConfig(url=nats_server.url, name="hooks"))
    seen = asyncio.Event()

    async def hook(client):
        assert client.is_connected
        seen.set()

    bus.on_connect(hook)
    bus.start()
    await asyncio.wait_for(seen.wait(), timeout=30)
    await bus.close()
