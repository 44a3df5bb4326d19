"""The e2e fixtures: the product stack (every service a process) once per session, on a
nats-server and redis-server of its own, so its router, workers and relays never take part in
another test's traffic on the session's servers."""

from __future__ import annotations

import pytest_asyncio
from product_stack import own_product_stack


@pytest_asyncio.fixture(scope="session")
async def product_stack(tmp_path_factory):
    async with own_product_stack(tmp_path_factory.mktemp("product")) as stack:
        yield stack
