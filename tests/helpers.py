"""Helpers the integration and e2e tests share: service processes and heartbeats.

A module of its own (not conftest): with several conftest.py files in the tree, `from conftest
import ...` would get whichever conftest was imported first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import uvicorn
from nats.aio.client import Client

from tandem.bus import decode, subjects
from tandem.bus.permissions import inbox_prefix
from tandem.devstack.bus_users import join_local_bus
from tandem.devstack.cassandra_node import SUPERUSER, find_java17
from tandem.devstack.devices import torch_threads_per_rank
from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.secrets import StackSecrets, login_of
from tandem.errors import StartupError
from tandem.store.cassandra_admin import migrate_store
from tandem.store.cassandra_schema import DEFAULT_BUCKET_SIZE
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat

REPO = Path(__file__).resolve().parent.parent
WORKER_ROLES = ("prefill", "decode")
TEST_WORKERS_SHARING_CORES = 4


def stack_secrets(nats_url: str) -> StackSecrets | None:
    """The credentials of the servers started on one work folder, from the operator's login in
    `nats_url` (the fixtures' `.url`); None for a URL without one."""
    operator_password = login_of(nats_url)[2]
    return StackSecrets.derived_from(operator_password) if operator_password else None


def service_env(role: str, nats_url: str, redis_url: str, **extra: str) -> dict[str, str]:
    """Environment for one service process on free ports, with fast heartbeats. The URLs are the
    servers' `.url` (with the operator's login and Redis's admin password): the process logs in as
    its own instance's bus user instead (admitted on the running server: tandem.devstack.bus_users),
    and as its role's Redis user (tandem.redis_acl) where the Redis is of the same set, else with
    the URL's login; the internal secret as a setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(join_local_bus(role, extra.get("TANDEM_INSTANCE_ID", f"{role}-test-{free_port()}"), nats_url))
    plain_redis_url, redis_username, redis_password = login_of(redis_url)
    made = stack_secrets(nats_url)
    if made is not None and redis_password == made.redis_password and role in made.redis_passwords:
        redis_username, redis_password = role, made.redis_passwords[role]
    env.update(
        PYTHONUNBUFFERED="1",
        TANDEM_REDIS_URL=plain_redis_url,
        TANDEM_REDIS_USERNAME=redis_username,
        TANDEM_REDIS_PASSWORD=redis_password,
        TANDEM_HTTP_PORT=str(free_port()),
        TANDEM_OPS_PORT=str(free_port()),
        TANDEM_HEARTBEAT_INTERVAL_S="0.2",
        TANDEM_API_KEYS="test-key=tester:plus",
    )
    if role in WORKER_ROLES:
        env["TANDEM_GRPC_PORT"] = str(free_port())
        # A test runs up to about four workers, and its own engine, on this machine's cores.
        env["TANDEM_TORCH_THREADS"] = str(torch_threads_per_rank(TEST_WORKERS_SHARING_CORES))
    env.update(extra)
    return env


def ops_url(env: dict[str, str]) -> str:
    """The base URL of /healthz, /readyz, /metrics, /version and the API docs of a process started
    with `env` (service_env's): its ops port, never its HTTP port."""
    return f"http://127.0.0.1:{env['TANDEM_OPS_PORT']}"


def service_process(role: str, env: dict[str, str]) -> ChildProcess:
    return ChildProcess(role, [sys.executable, "-m", f"services.{role}"], env=env, cwd=str(REPO))


async def next_heartbeat(
    nc: Client, role: str, instance_id: str, accept: Callable[[ServiceHeartbeat], bool] = lambda hb: True, timeout_s: float = 60
) -> ServiceHeartbeat | WorkerHeartbeat:
    """The next heartbeat of one instance that `accept` likes (workers send WorkerHeartbeat)."""
    message_type = WorkerHeartbeat if role in WORKER_ROLES else ServiceHeartbeat
    found: asyncio.Future[ServiceHeartbeat | WorkerHeartbeat] = asyncio.get_running_loop().create_future()

    async def on_message(msg: nats.aio.msg.Msg) -> None:
        heartbeat = decode(msg.data, message_type)
        service = heartbeat.service if isinstance(heartbeat, WorkerHeartbeat) else heartbeat
        if accept(service) and not found.done():
            found.set_result(heartbeat)

    subscription = await nc.subscribe(subjects.heartbeat(role, instance_id), cb=on_message)
    try:
        return await asyncio.wait_for(found, timeout_s)
    finally:
        await subscription.unsubscribe()


def interrupt_and_wait(up: ChildProcess, timeout_s: float = 60.0) -> None:
    """Ctrl-C to a launcher's process group (`tandem up`, `make run`), then waits for it to exit;
    past `timeout_s` it is killed and the timeout raised."""
    os.killpg(up.pid, signal.SIGINT)
    try:
        up.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        up.stop(timeout_s=1)
        raise


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper that a container may not have)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def children_of(pid: int) -> list[int]:
    """The processes `pid` started (a worker's engine process), from each of its threads' list."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()]


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP, then waits until every thread of the process has stopped. kill() returns once the
    signal is queued; the process's threads stop one by one as the kernel next runs each, so on a
    busy machine a server can still answer a request sent right after it (seen with Cassandra)."""
    os.kill(pid, signal.SIGSTOP)
    deadline_s = time.monotonic() + timeout_s
    while not _has_stopped(pid):
        if time.monotonic() > deadline_s:
            raise AssertionError(f"pid {pid} still has running threads {timeout_s} s after SIGSTOP")
        time.sleep(0.002)


def _has_stopped(pid: int) -> bool:
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            state = stat.read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        if state not in ("T", "t"):
            return False
    return True


async def wait_until(check, timeout_s: float = 30.0, interval_s: float = 0.1):
    """Polls an async condition until it returns something truthy (for state another process
    writes, where no event announces it); fails with the last value after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s (last: {value!r})")
        await asyncio.sleep(interval_s)


def cassandra_tools_missing() -> str | None:
    """Why no Cassandra node can be started on this machine, or None when JDK 17 and mvn are here."""
    if shutil.which("mvn") is None:
        return "mvn is not installed (Cassandra's jars come from Maven Central)"
    try:
        find_java17()
    except StartupError as exc:
        return str(exc)
    return None


CASSANDRA_APP_PASSWORD = f"app-{os.urandom(8).hex()}"  # the services' role's, for every keyspace of this run


def cassandra_admin() -> tuple[str, str]:
    """The admin login: TANDEM_CASSANDRA_USERNAME/_PASSWORD beside a TANDEM_CASSANDRA_HOSTS cluster, else a launched node's superuser."""
    if os.environ.get("TANDEM_CASSANDRA_USERNAME"):
        return os.environ["TANDEM_CASSANDRA_USERNAME"], os.environ.get("TANDEM_CASSANDRA_PASSWORD", "")
    return SUPERUSER


def cassandra_app_role(keyspace: str) -> str:
    """A role per keyspace: a migration leaves its role's grants on its own keyspace alone."""
    return f"{keyspace}_app"


async def migrate_cassandra(hosts: str, keyspace: str, bucket_size: int = DEFAULT_BUCKET_SIZE, *, ca_file: str) -> dict[str, str]:
    """`tandem store migrate`'s step on `keyspace`, as the admin, over TLS verified against
    `ca_file` (empty: in clear); returns the login a store of the services uses there (its
    application role's username and password, and the CA)."""
    admin_username, admin_password = cassandra_admin()
    role = cassandra_app_role(keyspace)
    await migrate_store(
        hosts,
        admin_username=admin_username,
        admin_password=admin_password,
        keyspace=keyspace,
        app_role=role,
        app_password=CASSANDRA_APP_PASSWORD,
        bucket_size=bucket_size,
        ca_file=ca_file,
    )
    return {"username": role, "password": CASSANDRA_APP_PASSWORD, "ca_file": ca_file}


@contextlib.contextmanager
def served_in_thread(app: Any, **config: Any) -> Iterator[int]:
    """`app` served by uvicorn on a free local port, in a daemon thread (a response stuck in its
    send cannot hold up the test or its end); yields the port, stops the server after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start within 10 s"
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


async def instance_client(nats_url: str, role: str, instance_id: str, on_error: Callable[[Exception], Awaitable[None]]) -> Client:
    """A bus client logged in as `instance_id`'s own user with its own inbox (admitted on the
    running server at `nats_url`, its operator URL), the server's refusals going to `on_error`."""
    env = join_local_bus(role, instance_id, nats_url)
    return await nats.connect(
        env["TANDEM_NATS_URL"],
        user=env["TANDEM_NATS_USER"],
        password=env["TANDEM_NATS_PASSWORD"],
        inbox_prefix=inbox_prefix(role, instance_id),
        error_cb=on_error,
        allow_reconnect=False,
    )
