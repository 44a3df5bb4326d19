"""`tandem up`: the whole local stack as real processes — nats-server, redis-server and the
services (N decode and M prefill workers, one router, one relay, one or more chat instances) —
with prefixed logs, readiness, restarts with backoff, and an orderly stop on Ctrl-C.

It serves two models: the large one (the configured weights, or the embedded SmolLM2) on those
workers, and a small one on `small_decode_workers` more decode workers ("small-decode-0", ...;
they prefill locally) with int8 weights from small_model_path or the large model's file; chat and
router are told both names for `auto` and the pools' fallbacks. With --tensor-parallel-size N the
large model's workers are N ranks each: on a host with GPUs N GPUs each, else a share of the
cores each rank (tandem.devstack.devices).

The same `Stack` is the failure drills' harness (bench/drills.py), from Python:

    config = StackConfig(host="127.0.0.1", chat_port=proc.free_ports(2), api_keys=keys, extra_env={...},
                         num_decode_workers=2, num_prefill_workers=1, num_chat_instances=2)
    async with Stack(config, Console(open("stack.log", "w"))) as stack:   # every member /readyz green
        stack.member("decode-0").pid          # its process now (None while it is down)
        stack.members_of("decode")            # [Member decode-0, Member decode-1], with ports and urls
        stack.chat_urls, stack.nats_url, stack.redis_url   # the URLs carry the operator's login
        stack.send_signal("decode-1", signal.SIGKILL)   # the supervisor restarts it (backoff 1 s, 2 s, ...)
        stack.send_signal("decode-0", signal.SIGSTOP)   # frozen (its pid stays); SIGCONT thaws it
        await stack.restart("redis")          # stopped (SIGTERM) and started again on the same port
        await stack.hold("nats"); ...; await stack.release("nats")   # down until released
        await stack.wait_ready("decode-1", timeout_s=120)

A member's name is its role when the stack runs one of that role ("router", "relay", "nats",
"redis"; --ha's NATS nodes are "nats-0" .. "nats-2"), else its instance id ("decode-0"). Each
service instance keeps its instance id, HTTP port, ops port (/healthz, /readyz, /metrics:
Member.ops_url, said at start) and (workers) gRPC port across its restarts: chat instance i
listens on chat_port + i (checked free at start), the rest take free ports. Servers restart on
the same port with the same data directory: JetStream's store and Redis's append-only file
survive a restart.

Both servers require a login (tandem.devstack.servers) and take no plaintext TCP client: NATS
requires TLS, Redis has a TLS port or only a unix socket (tandem.devstack.redis_listen), with a
development CA and certificates made at each start (tandem.devstack.certs). Each service gets its
instance's bus user, its role's certificate and Redis user, and the internal secret; the stack's
URLs carry the operator's login for tools, and <work folder>/operator.env holds it as settings.
Nothing outlives the work folder. Once NATS is up the stack runs `tandem bus init` as the
operator, so the token stream exists before any service starts. With TANDEM_STORE=cassandra (a
node of its own: `tandem cassandra up`) it runs `tandem store migrate` with the caller's login,
the admin's, and hands chat and relay the application role's login instead.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from tandem.bus.permissions import OPERATOR
from tandem.devstack.announce import ready_lines
from tandem.devstack.bus_users import admit
from tandem.devstack.certs import CertSet, make_cert_set
from tandem.devstack.hosts import Host, HostNetwork
from tandem.devstack.members import HA_NATS_NODES, Console, Member, StackConfig, check_chat_ports_free, member_name_of, service_member
from tandem.devstack.proc import ChildProcess
from tandem.devstack.redis_ha import RedisHA, member_names, start_redis_ha
from tandem.devstack.secrets import env_file_text, load_or_create, with_login, write_private
from tandem.devstack.servers import (
    EmbeddedServer,
    NatsCluster,
    NatsNode,
    plan_nats_cluster,
    start_nats,
    start_nats_node,
    start_redis,
)
from tandem.devstack.stack_settings import stack_config_from
from tandem.devstack.supervisor import signal_child, supervise
from tandem.errors import StartupError
from tandem.ops.bus_init import describe, init_bus
from tandem.ops.store_migrate import StoreAdmin
from tandem.store.cassandra_roles import APP_ROLE
from tandem.tls import TlsSettings

__all__ = ["Console", "Member", "Stack", "StackConfig", "stack_config_from"]


def _placed(host: Host | None) -> dict[str, Any]:
    """A server's bind address and command prefix on `host` (none: the machine's loopback)."""
    return {} if host is None else {"bind": host.address, "prefix": host.prefix}


OPERATOR_FILE = "operator.env"


class Stack:
    def __init__(self, config: StackConfig, console: Console | None = None) -> None:
        self._config = config
        self._console = console or Console()
        self._workdir = Path(tempfile.mkdtemp(prefix="tandem-up-"))
        self._members: list[Member] = []
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._num_signals = 0
        self._is_stopped = False
        self.nats_url = ""  # with the operator's login
        self.redis_url = ""  # with the password
        self.network: HostNetwork | None = None  # config.separate_hosts: every member's host
        self.redis_ha: RedisHA | None = None  # --ha: the Sentinel set; redis_url is its first primary
        self.certs: CertSet | None = None  # the development CA and every service's certificate, once started

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> int:
        """`tandem up`: runs until SIGINT/SIGTERM; returns the exit status."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal)
        try:
            await self.start()
        except StartupError as exc:
            self._console.say(str(exc))
            await self.stop()
            return 1
        try:
            self._announce()
            await self._stopping.wait()
            return 0
        finally:
            await self.stop()

    async def start(self) -> None:
        """Starts every member and returns once each is ready; raises StartupError (after
        stopping what started) when a chat port is taken, when one is not ready in time or a stop
        was asked meanwhile."""
        check_chat_ports_free(self._config)
        self._console.say(f"starting the local stack (pid {os.getpid()}) in {self._workdir}")
        if self._config.separate_hosts:
            self.network = HostNetwork()
            self._console.say(f"every member on a host of its own, on {self.network.subnet} (bridge {self.network.bridge})")
        on = self._host_for
        admit(self._workdir, load_or_create(self._workdir), self._config.identities())  # before the bus reads its users
        # The servers' hosts first: their certificates name the addresses their peers dial.
        nats_hosts = [on(name) for name in ([f"nats-{i}" for i in range(HA_NATS_NODES)] if self._config.ha else ["nats"])]
        redis_hosts = {name: on(name) for name in (member_names() if self._config.ha else ["redis"])}
        self.certs = make_cert_set(
            self._workdir,
            addresses={
                "nats": [host.address for host in nats_hosts if host is not None],
                "redis": [host.address for host in redis_hosts.values() if host is not None],
            },
        )
        nats = await self._start_bus(nats_hosts)
        if self._config.ha:
            redis = await self._start_redis_ha(redis_hosts)
        else:
            redis_host = redis_hosts["redis"]
            redis = await self._start_server(
                "redis",
                lambda port: start_redis(
                    self._workdir,
                    self._console.line,
                    port=port,
                    **_placed(redis_host),
                    certs=self.certs,
                    is_socket_allowed=not self._config.separate_hosts,
                ),
                redis_host,
            )
            if redis.listener is not None:
                self._console.say(f"redis listens on {redis.listener.describe()}")
        self.nats_url, self.redis_url = nats.url, redis.url
        self._write_operator_file(nats, redis)
        config = self._config
        if config.store_admin is not None:
            await self._migrate_store(config.store_admin, nats.secrets.cassandra_app_password)
        if self.redis_ha is not None:  # the services find the primary through the sentinels
            config = replace(config, extra_env={**config.extra_env, **self.redis_ha.service_env()})
        for role, index, pool in config.planned():
            host = on(member_name_of(role, index, pool, config))
            member = service_member(
                config, role, index, nats.address, redis.address, nats.secrets, self._console.line, pool, host, self.certs
            )
            self._members.append(member)
        self._supervisors = [
            asyncio.create_task(
                supervise(m, stopping=self._stopping, say=self._console.say, stable_after_s=self._config.stable_after_s),
                name=f"supervise:{m.name}",
            )
            for m in self._members
        ]
        problem = await self._wait_all_ready()
        if problem:
            await self.stop()
            raise StartupError(problem)

    async def stop(self) -> None:
        """Services first (they drain), then redis and nats; SIGKILL whatever outlives the timeout."""
        if self._is_stopped:
            return
        self._is_stopped = True
        self._stopping.set()
        services = [m for m in self._members if not m.is_server]
        servers = [m for m in self._members if m.is_server]
        for group in (services, servers):
            running = [m.child for m in group if m.child is not None and m.child.poll() is None]
            for child in running:
                signal_child(child.pid, signal.SIGCONT)  # a SIGSTOPped member hears its SIGTERM too
                signal_child(child.pid, signal.SIGTERM)
            await asyncio.gather(*(self._reap(child) for child in running))
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        self._supervisors, self._members = [], []
        if self.network is not None:
            self.network.close()
        shutil.rmtree(self._workdir, ignore_errors=True)
        self._console.say("stopped; nothing left running")

    async def __aenter__(self) -> Stack:
        try:
            await self.start()
        except BaseException:  # cancelled or failed part way: stop what started, remove the hosts
            await self.stop()
            raise
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    # -- what drills use ---------------------------------------------------------------------

    @property
    def operator_tls(self) -> TlsSettings | None:
        """The operator's certificate, what a tool or test connects to the stack's NATS with
        (`nats.connect(stack.nats_url, **nats_tls_options(stack.operator_tls))`)."""
        return None if self.certs is None else self.certs.settings(OPERATOR)

    @property
    def members(self) -> list[Member]:
        return list(self._members)

    def member(self, name: str) -> Member:
        for member in self._members:
            if member.name == name:
                return member
        raise KeyError(f"no member named {name!r}; members: {', '.join(m.name for m in self._members)}")

    def members_of(self, role: str) -> list[Member]:
        return [m for m in self._members if m.role == role]

    @property
    def chat_urls(self) -> list[str]:
        return [m.url for m in self.members_of("chat")]

    def host(self, name: str) -> Host:
        """The host member `name` runs on (separate_hosts only)."""
        if self.network is None:
            raise KeyError("the stack runs on one host: start it with separate_hosts")
        return self.network.hosts[name]

    def send_signal(self, name: str, signum: int) -> int:
        """Sends `signum` to the member's process now; returns its pid. A process that exits is
        restarted by its supervisor (with backoff); to keep one down, use hold."""
        member = self.member(name)
        pid = member.pid
        if pid is None:
            raise ProcessLookupError(f"{name} has no running process")
        os.kill(pid, signum)
        return pid

    async def hold(self, name: str, signum: int = signal.SIGTERM) -> None:
        """Stops the member with `signum` (SIGKILL after the stop timeout) and keeps it down until
        `release`; returns once no process of it runs."""
        member = self.member(name)
        member.is_held = True
        member.wake.set()
        if member.pid is not None:
            signal_child(member.pid, signal.SIGCONT)  # a SIGSTOPped process would never act on the signal
            signal_child(member.pid, signum)
        try:
            await asyncio.wait_for(member.is_parked.wait(), self._config.stop_timeout_s)
        except TimeoutError:
            self._console.say(f"{name} did not stop in {self._config.stop_timeout_s:.0f} s; killing it")
            if member.pid is not None:
                signal_child(member.pid, signal.SIGKILL)
            await asyncio.wait_for(member.is_parked.wait(), self._config.stop_timeout_s)

    async def release(self, name: str, timeout_s: float | None = None) -> None:
        """Starts a held member at once (no backoff) and waits until it is ready."""
        member = self.member(name)
        member.is_held = False
        member.wake.set()
        await self.wait_ready(name, timeout_s)

    async def restart(self, name: str, signum: int = signal.SIGTERM, timeout_s: float | None = None) -> None:
        """hold, then release: the member's process is replaced and ready again when this returns."""
        await self.hold(name, signum)
        await self.release(name, timeout_s)

    async def wait_ready(self, name: str, timeout_s: float | None = None) -> None:
        """Waits until the member is up and ready (its /readyz answers 200); TimeoutError after
        `timeout_s` (default: the stack's ready timeout)."""
        member = self.member(name)
        await asyncio.wait_for(member.is_ready.wait(), timeout_s or self._config.ready_timeout_s)

    # -- members -----------------------------------------------------------------------------

    async def _start_bus(self, hosts: list[Host | None]) -> EmbeddedServer | NatsCluster:
        """NATS (--ha: a cluster, members nats-0, nats-1, ...; `hosts`: each node's), then the admin
        step that makes the token stream (`tandem bus init`, as the operator): the services only wait for it."""
        if not self._config.ha:
            host = hosts[0]
            nats: EmbeddedServer | NatsCluster = await self._start_server(
                "nats", lambda port: start_nats(self._workdir, self._console.line, port=port, **_placed(host), certs=self.certs), host
            )
        else:
            nodes = plan_nats_cluster(HA_NATS_NODES, hosts)
            started = []
            for node, node_host in zip(nodes, hosts, strict=True):  # each restarts on its own ports and store

                def start(_: int | None, node: NatsNode = node) -> EmbeddedServer:
                    return start_nats_node(self._workdir, node, nodes, self._console.line, self.certs)

                started.append(await self._start_server("nats", start, node_host, name=node.name))
            nats = NatsCluster(started)
        try:
            stream = await init_bus(nats.url, self._config.token_stream, tls=self.operator_tls)
        except StartupError:
            await self.stop()  # the servers started so far
            raise
        self._console.say(f"tandem bus init: token stream {describe(stream)}")
        return nats

    async def _migrate_store(self, admin: StoreAdmin, app_password: str) -> None:
        """`tandem store migrate` with the caller's Cassandra login (the admin's); the services are
        handed the application role's, with this stack's password for it (service_member)."""
        try:
            await admin.migrate(APP_ROLE, app_password)
        except StartupError:
            await self.stop()  # the servers started so far
            raise
        self._console.say(f"tandem store migrate: keyspace {admin.keyspace}; chat and relay log in as {APP_ROLE}")

    def _write_operator_file(self, nats: EmbeddedServer | NatsCluster, redis: EmbeddedServer) -> None:
        """The operator's login as settings, for tools run next to the stack (`set -a; . FILE`)."""
        operator = {
            "TANDEM_NATS_URL": nats.address,
            "TANDEM_NATS_USER": OPERATOR,
            "TANDEM_NATS_PASSWORD": nats.secrets.operator_password,
            "TANDEM_REDIS_URL": redis.address,
            "TANDEM_REDIS_PASSWORD": redis.secrets.redis_password,
            **(self.operator_tls.env() if self.operator_tls is not None else {}),
        }
        if self.redis_ha is not None:
            operator |= self.redis_ha.service_env()
        write_private(self._workdir / OPERATOR_FILE, env_file_text(operator))

    def _host_for(self, name: str) -> Host | None:
        return None if self.network is None else self.network.add(name)

    async def _start_server(
        self, role: str, start: Callable[[int | None], EmbeddedServer], host: Host | None = None, name: str = ""
    ) -> EmbeddedServer:
        server = await asyncio.to_thread(start, None)
        port = urlsplit(server.address).port  # none: a unix socket, the same path each time

        def relaunch() -> ChildProcess:  # the same port, so every client reconnects by itself
            return start(port).child

        member = Member(name=name or role, role=role, launch=relaunch, readyz_url=None, url=server.address, child=server.child)
        member.is_ready.set()
        self._members.append(member)
        self._console.say(f"{member.name} started (pid {server.pid}) at {server.address}{f' on host {host.name}' if host else ''}")
        return server

    async def _start_redis_ha(self, hosts: dict[str, Host | None]) -> EmbeddedServer:
        """--ha: the Sentinel set, each node and sentinel a member ("redis-0", the first primary,
        "redis-1", "redis-sentinel-0", ...; `hosts`: each one's); its first primary stands for it
        as the stack's redis."""
        ha = await asyncio.to_thread(start_redis_ha, self._workdir, self._console.line, place=hosts.get, certs=self.certs)
        self.redis_ha = ha
        self._members += ha.members()
        primary = ha.nodes[0]
        self._console.say(f"redis with failover: primary {primary.address}, sentinels {ha.sentinel_spec}; they listen on {ha.describe()}")
        url = with_login(primary.address, "", ha.secrets.redis_password)
        return EmbeddedServer(url=url, child=ha.children[primary.name], address=primary.address, secrets=ha.secrets)

    async def _wait_all_ready(self) -> str:
        """ "" once every member is ready; else what went wrong."""
        everyone = asyncio.gather(*(m.is_ready.wait() for m in self._members))
        stopping = asyncio.ensure_future(self._stopping.wait())
        either: set[asyncio.Future[Any]] = {everyone, stopping}
        done, _ = await asyncio.wait(either, timeout=self._config.ready_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if everyone in done:
            return ""
        everyone.cancel()
        if self._stopping.is_set():
            return "stopped while starting"
        waiting = [m for m in self._members if not m.is_ready.is_set()]
        return f"not ready after {self._config.ready_timeout_s:.0f} s: {', '.join(m.name for m in waiting)}; stopping"

    def _on_signal(self) -> None:
        self._num_signals += 1
        if self._num_signals == 1:
            self._console.say("stopping (Ctrl-C again to kill at once)")
            self._stopping.set()
        else:
            for member in self._members:
                if member.pid is not None:
                    signal_child(member.pid, signal.SIGKILL)

    def _announce(self) -> None:
        host, port = self._config.host, self._config.chat_port
        if self.network is not None and self.members_of("chat"):
            host = self.network.hosts[self.members_of("chat")[0].name].address
        for line in ready_lines(
            self._config, self._members, f"http://{host}:{port}", self.nats_url, self.operator_tls, self._workdir / OPERATOR_FILE
        ):
            self._console.say(line)

    async def _reap(self, child: ChildProcess) -> None:
        try:
            await asyncio.wait_for(child.wait_async(), timeout=self._config.stop_timeout_s)
        except TimeoutError:
            self._console.say(f"{child.name} did not stop in {self._config.stop_timeout_s:.0f} s; killing it")
            child.process.kill()
            await child.wait_async()
