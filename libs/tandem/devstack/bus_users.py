"""The local nats-server's users: the operator and one per service instance (tandem.bus.permissions'
Identity), each bound to its own instance id. A work folder lists the instances it admits in
INSTANCES_FILE; their users are rendered into AUTH_FILE, which every server config of the folder
includes. `tandem up` admits the instances it plans before the bus starts; a process added to a
running bus (a test's) is admitted, then every server of the folder reloads its config (SIGHUP)
and the new login is tried until it works or a deadline passes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import nats

from tandem.bus.connection import server_urls, without_credentials
from tandem.bus.permissions import Identity
from tandem.devstack.certs import FOLDER, CertSet
from tandem.devstack.secrets import StackSecrets, local_service_env, login_of, write_private
from tandem.errors import StartupError
from tandem.tls import TlsSettings, nats_tls_options

INSTANCES_FILE = "nats-instances.txt"  # "<role> <instance id>" a line
AUTH_FILE = "nats-auth.conf"
LOGIN_TIMEOUT_S = 10.0
_RETRY_S = 0.02


def admitted(workdir: Path) -> list[Identity]:
    path = workdir / INSTANCES_FILE
    if not path.is_file():
        return []
    return [Identity(*line.split()) for line in path.read_text().splitlines() if line.strip()]


def write_auth(workdir: Path, secrets: StackSecrets) -> str:
    """Writes the folder's AUTH_FILE from its admitted instances; returns the config line that
    includes it (a server config in the same folder)."""
    write_private(workdir / AUTH_FILE, secrets.nats_config(admitted(workdir)))
    return f'include "{AUTH_FILE}"\n'


def admit(workdir: Path, secrets: StackSecrets, identities: Iterable[Identity]) -> bool:
    """Adds `identities` to the folder's users and rewrites AUTH_FILE; whether any was new (a
    running server then needs `reload`)."""
    known = admitted(workdir)
    new = [identity for identity in identities if identity not in known]
    if new:
        write_private(workdir / INSTANCES_FILE, "".join(f"{i.role} {i.instance_id}\n" for i in [*known, *new]))
        write_auth(workdir, secrets)
    return bool(new)


def reload(
    pids: Iterable[int],
    address: str,
    identity: Identity,
    secrets: StackSecrets,
    tls: TlsSettings | None,
    timeout_s: float = LOGIN_TIMEOUT_S,
) -> None:
    """Has the servers `pids` reread their config, and returns once `identity` can log in at each
    node of `address` (over TLS with `tls` where the servers require it); StartupError past
    `timeout_s`."""
    for pid in pids:
        os.kill(pid, signal.SIGHUP)
    with ThreadPoolExecutor(1) as pool:  # a caller's event loop may be running
        pool.submit(asyncio.run, _until_login(address, identity, secrets, tls, timeout_s)).result()


async def _until_login(address: str, identity: Identity, secrets: StackSecrets, tls: TlsSettings | None, timeout_s: float) -> None:
    deadline_s = time.monotonic() + timeout_s
    for url in server_urls(address):
        while True:
            try:
                client = await nats.connect(
                    url,
                    user=identity.instance_id,
                    password=secrets.instance_password(identity.instance_id),
                    **nats_tls_options(tls),
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                    connect_timeout=1,
                    error_cb=_quiet,
                )
            except (nats.errors.Error, OSError) as exc:  # refused: the reload has not happened yet
                if time.monotonic() > deadline_s:
                    raise StartupError(f"{identity.instance_id} cannot log in at {url} {timeout_s} s after a reload: {exc}") from exc
                await asyncio.sleep(_RETRY_S)
                continue
            await client.close()
            break


def join_local_bus(role: str, instance_id: str, nats_url: str) -> dict[str, str]:
    """The settings of a new process of `role` on a running local bus known by its operator URL
    (a test server's or a stack's `.url`, a bench's): admits `instance_id` on the nats-server(s)
    listening at the URL's ports on this machine, and returns once its login works. Where the
    servers' work folder holds a certificate set (a stack's: its NATS requires TLS), the settings
    carry the role's certificate too."""
    env = local_service_env(role, instance_id, nats_url)
    address, _, operator_password = login_of(nats_url)
    if not operator_password:
        return env
    secrets = StackSecrets.derived_from(operator_password)
    servers = [_local_server(url) for url in server_urls(address)]
    certs = CertSet(servers[0][1] / FOLDER)
    tls = certs.settings(role) if certs.ca_file.is_file() else None
    if tls is not None:
        env.update(tls.env())
    identity = Identity(role, instance_id)
    if admit(servers[0][1], secrets, [identity]):
        reload([pid for pid, _ in servers], address, identity, secrets, tls)
    return env


def _local_server(url: str) -> tuple[int, Path]:
    """(pid, work folder) of the nats-server on this machine that listens at `url`'s port."""
    port = urlsplit(url).port
    inodes = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or (proc / "comm").read_text().strip() != "nats-server":
                continue
            if not inodes & {os.readlink(fd) for fd in (proc / "fd").iterdir()}:
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            config = Path(os.readlink(proc / "cwd")) / argv[argv.index(b"-c") + 1].decode()
        except (FileNotFoundError, PermissionError, ValueError):  # gone meanwhile, another user's, no -c
            continue
        return int(proc.name), config.parent
    raise StartupError(f"no nats-server of this user listens at {without_credentials(url)} on this machine")


def _listening_inodes(port: int | None) -> list[str]:
    found = []
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.append(fields[9])
    return found


async def _quiet(exc: Exception) -> None:
    """The refusals before the reload are expected: `_until_login` says when one lasts too long."""
