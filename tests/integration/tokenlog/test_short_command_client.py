"""The services' pooled Redis client across a Redis restart: the connections the pool held are
closed by then, and a command that finds one so runs again on a new one instead of failing (in
the rolling drill, a chat instance answered two new messages 503 that way after Redis had been
restarted minutes before)."""

from __future__ import annotations

import asyncio

from durable_redis import DurableRedis

from tandem.devstack.proc import free_port
from tandem.runtime.runtime import short_command_client


async def test_every_pooled_connection_closed_by_a_restart_is_replaced_without_an_error(tmp_path):
    server = DurableRedis(tmp_path, free_port())
    server.start()
    client = short_command_client(server.url, max_connections=4, login={})
    try:
        # Four commands at once: the pool opens four connections and keeps them.
        await asyncio.gather(*(client.set(f"k{i}", i, ex=60) for i in range(4)))
        kept = {id(c) for c in client.connection_pool._available_connections}  # type: ignore[attr-defined]
        assert len(kept) == 4
        server.stop()
        server.start()
        values = await asyncio.gather(*(client.get(f"k{i}") for i in range(4)), return_exceptions=True)
        assert values == [str(i).encode() for i in range(4)], "the append-only file kept them; no command failed"
    finally:
        await client.aclose()
        server.stop()
