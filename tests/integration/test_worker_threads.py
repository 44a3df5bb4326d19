"""A worker's engine runs on the torch threads TANDEM_TORCH_THREADS gives it (workers sharing a
machine's cores split them instead of each taking one per core), and on the CPUs
TANDEM_CPU_AFFINITY names, on a real decode worker."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import children_of, service_env, service_process

from tandem.devstack.proc import ChildProcess

pytestmark = pytest.mark.real_model


@contextlib.contextmanager
def decode_worker(nats_server, redis_server, **env_changes: str | None) -> Iterator[tuple[ChildProcess, int]]:
    """A decode worker with `env_changes` (None removes a variable), once its engine is ready, and
    the torch threads it says it computes on."""
    env = service_env("decode", nats_server.url, redis_server.url, TANDEM_KV_CACHE_MIB="64")
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    child = service_process("decode", env)
    child.start()
    try:
        ready = child.wait_for_line(r"engine ready: .* with (\d+) torch threads", timeout_s=120)
        assert ready is not None, child.recent_output(40)
        yield child, int(ready.group(1))
    finally:
        child.stop(timeout_s=10)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: torch's default is one thread already")
def test_a_decode_worker_computes_on_the_torch_threads_it_is_given(nats_server, redis_server):
    with decode_worker(nats_server, redis_server, TANDEM_TORCH_THREADS="1") as (_, num_threads):
        assert num_threads == 1


def cpus_of_every_thread(pid: int) -> set[str]:
    """Each thread's Cpus_allowed_list, as the kernel reports it, of the process and of its
    children (the engine process)."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            status = (task / "status").read_text()
            lists.add(re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.MULTILINE).group(1))
            for child in (task / "children").read_text().split():
                lists |= cpus_of_every_thread(int(child))
    return lists


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs and Linux affinity")
def test_a_decode_worker_pinned_to_one_cpu_runs_every_thread_there_and_computes_on_one_torch_thread(nats_server, redis_server):
    cpu = max(os.sched_getaffinity(0))
    # no TANDEM_TORCH_THREADS: the thread count comes from the affinity
    with decode_worker(nats_server, redis_server, TANDEM_CPU_AFFINITY=str(cpu), TANDEM_TORCH_THREADS=None) as (child, num_threads):
        assert num_threads == 1
        assert children_of(child.pid), "the engine runs in a process of its own (TANDEM_ENGINE_PROCESS)"
        assert cpus_of_every_thread(child.pid) == {str(cpu)}
