"""A started service keeps what it started with out of the cyclic collector's passes (gc.freeze),
makes full passes rarer (a chat holding thousands of streams paused in them for up to a second),
and times every pass into its metrics (libs/tandem/runtime/collector.py)."""

from __future__ import annotations

import asyncio
import gc
import socket

import uvicorn
from fastapi import FastAPI
from prometheus_client import REGISTRY

from tandem.runtime.collector import FULL_THRESHOLD, MIDDLE_THRESHOLD, YOUNG_THRESHOLD, PassTimer
from tandem.runtime.run import _DrainingServer


def num_full_passes_timed() -> float:
    return REGISTRY.get_sample_value("tandem_gc_pause_seconds_count", {"generation": "2"}) or 0.0


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
        assert gc.get_threshold() == (YOUNG_THRESHOLD, MIDDLE_THRESHOLD, FULL_THRESHOLD)
        assert previous[2] < FULL_THRESHOLD
        assert sum(isinstance(callback, PassTimer) for callback in gc.callbacks) == 1
        before = num_full_passes_timed()
        gc.collect(2)
        gc.collect(2)
        assert num_full_passes_timed() == before + 2
        assert (REGISTRY.get_sample_value("tandem_gc_pause_longest_seconds", {"generation": "2"}) or 0.0) > 0.0
    finally:
        gc.unfreeze()
        gc.set_threshold(*previous)
        gc.callbacks[:] = [callback for callback in gc.callbacks if not isinstance(callback, PassTimer)]
        sock.close()
