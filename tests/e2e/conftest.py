"""The e2e fixtures: the product stack (every service a process) once per session."""

from __future__ import annotations

import pytest_asyncio
from product_stack import start_product_stack


@pytest_asyncio.fixture(scope="session")
async def product_stack(nats_server, redis_server, tmp_path_factory):
    import nats

    nc = await nats.connect(nats_server.url)
    stack = await start_product_stack(nc, nats_server.url, redis_server.url, tmp_path_factory.mktemp("product"))
    await nc.close()
    yield stack
    for child in stack.children:
        child.stop(timeout_s=10)
