"""A started service keeps what it started with out of the cyclic collector's passes (gc.freeze)
and makes full passes rarer: a chat holding thousands of streams paused in them for up to a
second (libs/tandem/runtime/run.py)."""

from __future__ import annotations

import asyncio
import gc
import socket

import uvicorn
from fastapi import FastAPI

from tandem.runtime.run import GC_FULL_THRESHOLD, GC_MIDDLE_THRESHOLD, GC_YOUNG_THRESHOLD, _DrainingServer


def test_a_started_server_freezes_what_it_holds_and_makes_full_passes_rarer():
    previous = gc.get_threshold()
    gc.unfreeze()
    held = [object() for _ in range(10)]  # what a service's start leaves alive
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _DrainingServer(uvicorn.Config(FastAPI(), log_level="warning", lifespan="off"), runtime=None)

    async def start_and_stop() -> None:
        server.config.load()
        server.lifespan = server.config.lifespan_class(server.config)
        await server.startup(sockets=[sock])
        await server.shutdown(sockets=[sock])

    try:
        assert gc.get_freeze_count() == 0
        asyncio.run(start_and_stop())
        assert gc.get_freeze_count() >= len(held)
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, GC_MIDDLE_THRESHOLD, GC_FULL_THRESHOLD)
        assert previous[2] < GC_FULL_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*previous)
        sock.close()
