"""A worker's engine runs on the torch threads TANDEM_TORCH_THREADS gives it (workers sharing a
machine's cores split them instead of each taking one per core), on a real decode worker."""

from __future__ import annotations

import os

import pytest
from helpers import service_env, service_process

pytestmark = pytest.mark.real_model


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: torch's default is one thread already")
def test_a_decode_worker_computes_on_the_torch_threads_it_is_given(nats_server, redis_server):
    env = service_env("decode", nats_server.url, redis_server.url, TANDEM_KV_CACHE_MIB="64", TANDEM_TORCH_THREADS="1")
    child = service_process("decode", env)
    child.start()
    try:
        ready = child.wait_for_line(r"engine ready: .* with (\d+) torch threads", timeout_s=120)
        assert ready is not None, child.recent_output(40)
        assert ready.group(1) == "1"
    finally:
        child.stop(timeout_s=10)
