"""The embedded servers are real: JetStream works, Redis answers, and they stop when told."""

import nats
import redis.asyncio as aioredis

from tandem.devstack.servers import EmbeddedServer, start_redis


async def test_nats_has_jetstream_and_delivers(nats_server: EmbeddedServer):
    client = await nats.connect(nats_server.url)
    try:
        js = client.jetstream()
        await js.add_stream(name="probe", subjects=["probe.>"])
        ack = await js.publish("probe.one", b"hello")
        assert ack.seq == 1
        message = await js.get_msg("probe", 1)
        assert message.data == b"hello"
    finally:
        await client.close()


async def test_redis_answers(redis_server: EmbeddedServer):
    client = aioredis.from_url(redis_server.url)
    try:
        await client.set("probe", "value")
        assert await client.get("probe") == b"value"
    finally:
        await client.aclose()


def test_a_stopped_server_exits_cleanly(tmp_path):
    server = start_redis(tmp_path)
    assert server.stop() == 0
