"""What `tandem up` runs: its configuration, the console every child's output goes to, and one
`Member` per supervised process (a server or a service instance) with what a drill needs to
reach it: name, role, instance id, ports, pid."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from tandem.bus.permissions import Identity
from tandem.bus.token_stream import TokenStreamConfig
from tandem.config import DEFAULT_GRPC_PORTS, DEFAULT_HTTP_PORTS, ApiKey, Tier
from tandem.devstack.certs import CertSet
from tandem.devstack.devices import assign_gpus, torch_threads_per_rank
from tandem.devstack.hosts import Host
from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.secrets import CASSANDRA_LOGIN, StackSecrets
from tandem.errors import StartupError
from tandem.key_file import generate_key
from tandem.ops.store_migrate import StoreAdmin
from tandem.runtime.ops_port import OPS_PORT_OFFSET
from tandem.runtime.run import bind_port
from tandem.store.cassandra_roles import STORE_ROLES

SERVER_ROLES = ("nats", "redis")
HA_NATS_NODES = 3
SERVICE_ROLES = ("router", "relay", "prefill", "decode", "chat")
NAME_WIDTH = 15  # "small-decode-0" and a space
SMALL_POOL = "small"  # the small model's decode workers: small-decode-0, small-decode-1, ...
WORKER_ROLES = ("decode", "prefill")
# The large model's settings the small model's workers do not take: they keep its own window.
LARGE_MODEL_ONLY = ("TANDEM_MAX_MODEL_LEN",)


@dataclass(frozen=True)
class StackConfig:
    host: str
    chat_port: int  # the first chat instance's; instance i listens on chat_port + i
    api_keys: dict[str, ApiKey]
    extra_env: dict[str, str]  # passed to every service (model path, log level, settings given as flags, ...)
    num_decode_workers: int = 1
    num_prefill_workers: int = 1
    num_chat_instances: int = 1
    # Decode workers of the small model (no prefill workers: they prefill locally), with
    # `small_worker_env` over extra_env (its weights, quantization and served name).
    num_small_decode_workers: int = 0
    small_worker_env: dict[str, str] = field(default_factory=dict)
    # The large model's prefill and decode workers: ranks each (TANDEM_TENSOR_PARALLEL_SIZE, set
    # per worker); the small model's workers run one.
    tensor_parallel_size: int = 1
    # The host's GPUs the workers take, one per rank (assign_gpus); empty: they compute on the CPU.
    gpus: tuple[str, ...] = ()
    roles: tuple[str, ...] = SERVICE_ROLES  # the services to run; () runs the servers alone
    ready_timeout_s: float = 300.0
    stop_timeout_s: float = 10.0
    stable_after_s: float = 30.0  # a member that ran this long restarts from the first backoff step
    # Every member on a host of its own (tandem.devstack.hosts: a network namespace each, root
    # only), named after the member; `host` is then unused, each service binds its host's address.
    separate_hosts: bool = False
    # tandem up --ha: NATS as a cluster of HA_NATS_NODES (members nats-0, nats-1, ...), services
    # given every node's URL, and Redis with failover (tandem.devstack.redis_ha).
    ha: bool = False
    token_stream: TokenStreamConfig = TokenStreamConfig()  # what the stack's `tandem bus init` makes
    # TANDEM_STORE=cassandra: the admin's login the stack's `tandem store migrate` runs with; the
    # services are handed the application role's instead.
    store_admin: StoreAdmin | None = None

    def __post_init__(self) -> None:
        if "TANDEM_TENSOR_PARALLEL_SIZE" in self.extra_env:  # every worker's would be the stack's instead
            raise ValueError("set StackConfig.tensor_parallel_size, not TANDEM_TENSOR_PARALLEL_SIZE in extra_env")
        if self.token_stream.num_replicas > self.num_nats_nodes:
            raise StartupError(
                f"the token stream's {self.token_stream.num_replicas} replicas need as many NATS nodes; this stack runs "
                f"{self.num_nats_nodes}: set TANDEM_TOKEN_STREAM_REPLICAS to at most that (or use tandem up --ha)"
            )

    @property
    def num_nats_nodes(self) -> int:
        return HA_NATS_NODES if self.ha else 1

    def num_instances(self, role: str) -> int:
        counts = {"decode": self.num_decode_workers, "prefill": self.num_prefill_workers, "chat": self.num_chat_instances}
        return counts.get(role, 1)

    def identities(self) -> list[Identity]:
        """The bus user of every planned service instance (tandem.devstack.bus_users)."""
        return [Identity(role, instance_id_of(role, index, pool)) for role, index, pool in self.planned()]

    def planned(self) -> list[tuple[str, int, str]]:
        """(role, index, pool) of every service instance, in start order; pool "" is the large
        model's (or the only one), SMALL_POOL the small model's decode workers."""
        planned = []
        for role in self.roles:
            planned += [(role, index, "") for index in range(self.num_instances(role))]
            if role == "decode":
                planned += [(role, index, SMALL_POOL) for index in range(self.num_small_decode_workers)]
        return planned

    def worker_ranks(self) -> dict[str, int]:
        """Each worker's instance id -> its tensor-parallel ranks, in start order."""
        return {
            instance_id_of(role, index, pool): 1 if pool == SMALL_POOL else self.tensor_parallel_size
            for role, index, pool in self.planned()
            if role in WORKER_ROLES
        }

    def visible_gpus(self) -> dict[str, str]:
        """Each worker's CUDA_VISIBLE_DEVICES by instance id (none on a CPU); NotEnoughGpus when
        the host has fewer GPUs than the workers have ranks."""
        return assign_gpus(self.worker_ranks(), self.gpus) if self.gpus else {}

    @property
    def torch_threads(self) -> int:
        """Each worker rank's torch threads unless TANDEM_TORCH_THREADS says otherwise: every
        rank of every worker shares this machine's cores."""
        return torch_threads_per_rank(sum(self.worker_ranks().values()))

    @property
    def chat_ports(self) -> list[int]:
        """Consecutive ports from chat_port, one per chat instance (none when chat is not run)."""
        if "chat" not in self.roles:
            return []
        return [self.chat_port + index for index in range(self.num_chat_instances)]


class Console:
    """Prefixed, line-atomic output: `name | text`, to stdout or the stream given (a drill's log file)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out
        self._lock = threading.Lock()

    def line(self, name: str, text: str) -> None:
        out = self._out or sys.stdout
        with self._lock:
            out.write(f"{name:<{NAME_WIDTH}}| {text}\n")
            out.flush()

    def say(self, text: str) -> None:
        self.line("up", text)


@dataclass
class Member:
    """One supervised process. `launch` starts it and returns once it may be polled for readiness
    (a server: once it accepts connections)."""

    name: str  # the role when the stack runs one of it, else the instance id ("decode-1")
    role: str  # "nats", "redis", or a service role
    launch: Callable[[], ChildProcess]
    readyz_url: str | None  # None: ready as soon as launch returns
    instance_id: str = ""  # services: TANDEM_INSTANCE_ID, kept across restarts
    url: str = ""  # servers: nats://... or redis://...; services: http://host:port
    http_port: int | None = None
    ops_url: str = ""  # services: http://host:ops_port, where /healthz, /readyz and /metrics answer
    ops_port: int | None = None
    grpc_port: int | None = None  # workers' control server
    env: dict[str, str] = field(default_factory=dict)  # services: the environment each start gets
    child: ChildProcess | None = None
    is_ready: asyncio.Event = field(default_factory=asyncio.Event)
    num_quick_restarts: int = 0
    # Held down by Stack.hold until Stack.release: the supervisor leaves it stopped.
    is_held: bool = False
    is_parked: asyncio.Event = field(default_factory=asyncio.Event)  # held, and no process of it runs
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # cuts a backoff or a parked wait short

    @property
    def pid(self) -> int | None:
        """The pid of its process while one runs (a SIGSTOPped one included), else None."""
        if self.child is None or self.child.poll() is not None:
            return None
        return self.child.pid

    @property
    def is_server(self) -> bool:
        return self.role in SERVER_ROLES


def instance_id_of(role: str, index: int, pool: str = "") -> str:
    return f"{pool}-{role}-{index}" if pool else f"{role}-{index}"


def member_name(role: str, index: int, num_instances: int) -> str:
    return role if num_instances == 1 else f"{role}-{index}"


def member_name_of(role: str, index: int, pool: str, config: StackConfig) -> str:
    """A service instance's member name (and, on separate hosts, its host's)."""
    return instance_id_of(role, index, pool) if pool else member_name(role, index, config.num_instances(role))


def check_chat_ports_free(config: StackConfig) -> None:
    """Fails, naming the port and the instance, when a chat instance's port is taken or invalid
    (on hosts of their own, every port is free)."""
    if config.separate_hosts:
        return
    for index, port in enumerate(config.chat_ports):
        name = member_name("chat", index, config.num_chat_instances)
        setting = "TANDEM_HTTP_PORT or --port" if index == 0 else f"TANDEM_HTTP_PORT or --port ({name} takes that port + {index})"
        if port > 65535:
            raise StartupError(f"{name} would take port {port}, past 65535: set {setting} lower")
        try:
            bind_port(config.host, port, setting).close()
        except StartupError as exc:
            raise StartupError(f"{name}: {exc}") from None


def api_keys_spec(keys: dict[str, ApiKey]) -> str:
    return ",".join(f"{key}={api_key.user_id}:{api_key.tier.value}" for key, api_key in keys.items())


def dev_api_keys() -> dict[str, ApiKey]:
    return {generate_key("tdm-dev"): ApiKey(user_id="dev", tier=Tier.PLUS)}


def _set_worker_env(env: dict[str, str], config: StackConfig, instance_id: str, is_small: bool) -> None:
    """A worker's ranks, on a host with GPUs the GPUs they compute on, and each rank's torch threads
    (a count set in the environment, or as a flag, is kept); the small model's workers run one
    rank in their own window."""
    env["TANDEM_TENSOR_PARALLEL_SIZE"] = "1" if is_small else str(config.tensor_parallel_size)
    if is_small:
        for name in LARGE_MODEL_ONLY:
            env.pop(name, None)
    gpus = config.visible_gpus()
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[instance_id]
    env.setdefault("TANDEM_TORCH_THREADS", str(config.torch_threads))


def _http_port(config: StackConfig, role: str, index: int, on_host: Host | None) -> int:
    if role == "chat":
        return config.chat_port + index
    return free_port(config.host) if on_host is None else DEFAULT_HTTP_PORTS[role]  # a host's ports are all free


def service_member(
    config: StackConfig,
    role: str,
    index: int,
    nats_url: str,
    redis_url: str,
    secrets: StackSecrets,
    on_line: Callable[[str, str], None],
    pool: str = "",
    on_host: Host | None = None,
    certs: CertSet | None = None,
) -> Member:
    """Instance `index` of a service role: its own instance id, HTTP port, ops port and (workers)
    gRPC port, kept across its restarts; chat instance i listens on chat_port + i, the other
    services, every ops port and decode workers' UCX listeners take a free port each. `nats_url` is every NATS node's,
    comma-separated, on a stack with a cluster. It logs in to the bus as its instance's user
    (the URLs carry no login), with the Redis password and the internal secret of `secrets`.
    `pool` SMALL_POOL: a small-model decode worker, named by its instance id (small-decode-i).
    `on_host`: it runs on that host (separate_hosts), on its role's default ports. `certs`: it
    is given its role's certificate (TANDEM_TLS_*, tandem.tls)."""
    host = config.host if on_host is None else on_host.address
    http_port = _http_port(config, role, index, on_host)
    ops_port = free_port(host) if on_host is None else DEFAULT_HTTP_PORTS[role] + OPS_PORT_OFFSET
    # Kept across restarts: the router sees the same worker come back.
    instance_id = instance_id_of(role, index, pool)
    env = {
        **os.environ,
        **config.extra_env,
        "PYTHONUNBUFFERED": "1",
        "TANDEM_HOST": host,
        "TANDEM_HTTP_PORT": str(http_port),
        "TANDEM_OPS_PORT": str(ops_port),
        "TANDEM_NATS_URL": nats_url,
        "TANDEM_REDIS_URL": redis_url,
        "TANDEM_UCX_PORT": "0",
        "TANDEM_REDIS_USERNAME": "",  # not one from the caller's environment
        **secrets.service_env(role, instance_id),
        **(certs.settings(role).env() if certs is not None else {}),
        **(config.small_worker_env if pool == SMALL_POOL else {}),
    }
    for name in CASSANDRA_LOGIN:  # the caller's is the admin's: only the stack's migrate step uses it
        env.pop(name, None)
    if config.store_admin is not None and role in STORE_ROLES:
        env.update(secrets.cassandra_login())
    if role == "chat":  # the one service that checks keys: no other process is handed them
        env["TANDEM_API_KEYS"] = api_keys_spec(config.api_keys)
    else:
        env.pop("TANDEM_API_KEYS", None)
        env.pop("TANDEM_API_KEYS_FILE", None)
    if role in WORKER_ROLES:
        _set_worker_env(env, config, instance_id, is_small=pool == SMALL_POOL)
    grpc_port = None
    if role in DEFAULT_GRPC_PORTS:
        grpc_port = free_port(host) if on_host is None else DEFAULT_GRPC_PORTS[role]
        env["TANDEM_GRPC_PORT"] = str(grpc_port)
    name = member_name_of(role, index, pool, config)
    prefix = [] if on_host is None else on_host.prefix
    child = ChildProcess(name, [*prefix, sys.executable, "-m", f"services.{role}"], env=env, on_line=on_line)

    def launch() -> ChildProcess:
        child.start()
        return child

    ops_url = f"http://{host}:{ops_port}"
    return Member(
        name=name,
        role=role,
        launch=launch,
        readyz_url=f"{ops_url}/readyz",
        instance_id=instance_id,
        url=f"http://{host}:{http_port}",
        http_port=http_port,
        ops_url=ops_url,
        ops_port=ops_port,
        grpc_port=grpc_port,
        env=env,
    )
