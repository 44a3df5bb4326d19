"""The e2e fixtures: the product stack (every service a process) once per session, on a
nats-server and redis-server of its own, so its router, workers and relays never take part in
another test's traffic on the session's servers."""

from __future__ import annotations

import nats
import pytest_asyncio
from product_stack import start_product_stack

from tandem.devstack.servers import start_nats, start_redis


@pytest_asyncio.fixture(scope="session")
async def product_stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("product")
    nats_server, redis_server = start_nats(workdir), start_redis(workdir)
    nc = await nats.connect(nats_server.url)
    stack = await start_product_stack(nc, nats_server.url, redis_server.url, workdir)
    stack.nats_server = nats_server
    await nc.close()
    yield stack
    for child in stack.children:
        child.stop(timeout_s=10)
    redis_server.stop()
    nats_server.stop()
