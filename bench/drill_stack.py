"""The stack the failure drills run against: `tandem up`'s launcher (tandem.devstack.stack.Stack)
with several decode workers and chat instances, its output in a log file, plus what the drills
need beside it: the workers' latest heartbeats (to find the busiest worker) and waits on a
member's restart."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from types import TracebackType

import nats
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg

from services.relay.consumer import TokenConsumerConfig
from tandem.bus import BadMessage, decode
from tandem.bus.connection import server_urls
from tandem.bus.token_stream import STREAM, TokenStreamConfig
from tandem.config import ApiKey, Tier
from tandem.devstack.hosts import HostNetwork
from tandem.devstack.members import HA_NATS_NODES
from tandem.devstack.proc import free_ports
from tandem.devstack.stack import Console, Stack, StackConfig
from tandem.tls import nats_tls_options
from tandem.v1.worker_pb2 import WorkerHeartbeat

API_KEY = "drill-key"
ROLLING_ORDER = ("router", "relay", "prefill", "decode", "chat")


class DrillStack:
    def __init__(
        self,
        decode_workers: int = 2,
        prefill_workers: int = 1,
        chat_instances: int = 2,
        extra_env: dict[str, str] | None = None,
        api_keys: dict[str, ApiKey] | None = None,
        tensor_parallel_size: int = 1,
        separate_hosts: bool = False,
        ha: bool = False,
    ) -> None:
        self._workdir = Path(tempfile.mkdtemp(prefix="tandem-drills-"))
        self.log_path = self._workdir / "stack.log"
        env = {"TANDEM_STORE": "sqlite", "TANDEM_SQLITE_PATH": str(self._workdir / "conversations.db"), **(extra_env or {})}
        self._config = StackConfig(
            host="127.0.0.1",
            chat_port=free_ports(chat_instances),
            api_keys={API_KEY: ApiKey(user_id="driller", tier=Tier.PLUS), **(api_keys or {})},
            extra_env=env,
            num_decode_workers=decode_workers,
            num_prefill_workers=prefill_workers,
            num_chat_instances=chat_instances,
            tensor_parallel_size=tensor_parallel_size,
            ha=ha,  # as tandem up --ha: a NATS cluster, the token stream on every node
            token_stream=TokenStreamConfig(num_replicas=HA_NATS_NODES if ha else 1),
            stable_after_s=5.0,  # drills kill the same member again soon: restart it after 1 s each time
            separate_hosts=separate_hosts,
        )
        self._log = self.log_path.open("w")
        self._stack = Stack(self._config, Console(self._log))
        self._nc: Nats | None = None
        self.heartbeats: dict[str, WorkerHeartbeat] = {}
        self.api_key = API_KEY
        self.healed_unix_s = 0.0  # set by a partition drill when it heals the partition

    async def __aenter__(self) -> DrillStack:
        await self._stack.__aenter__()
        self._nc = await nats.connect(
            server_urls(self._stack.nats_url),
            **nats_tls_options(self._stack.operator_tls),
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
        )
        await self._nc.subscribe("tandem.v1.heartbeat.*.*", cb=self._on_heartbeat)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._nc is not None:
            await self._nc.close()
        await self._stack.__aexit__(kind, exc, tb)
        self._log.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

    async def _on_heartbeat(self, msg: Msg) -> None:
        if msg.subject.split(".")[-2] not in ("decode", "prefill"):
            return
        try:
            heartbeat = decode(msg.data, WorkerHeartbeat)
        except BadMessage:
            return
        self.heartbeats[heartbeat.service.instance_id] = heartbeat

    async def stream_leaders(self) -> tuple[str, str]:
        """The servers leading the token stream and the relay's consumer now (a cluster's raft
        groups; a node's loss that takes a leader waits for an election)."""
        assert self._nc is not None
        js = self._nc.jetstream()
        stream = (await js.stream_info(STREAM)).cluster
        consumer = (await js.consumer_info(STREAM, TokenConsumerConfig().durable)).cluster
        return (stream and stream.leader) or "", (consumer and consumer.leader) or ""

    @property
    def chat_urls(self) -> list[str]:
        return self._stack.chat_urls

    @property
    def stack(self) -> Stack:
        return self._stack

    @property
    def network(self) -> HostNetwork:
        """The hosts' network (a stack started with separate_hosts)."""
        if self._stack.network is None:
            raise RuntimeError("the stack runs on one host: this drill needs --hosts")
        return self._stack.network

    def members(self, role: str) -> list[str]:
        return [member.name for member in self._stack.members_of(role)]

    def service_members(self) -> list[str]:
        """Every service, in the order a rolling restart goes through them."""
        return [name for role in ROLLING_ORDER for name in self.members(role)]

    def signal(self, name: str, signum: int) -> int:
        """Sends `signum` to member `name`; returns its pid."""
        return self._stack.send_signal(name, signum)

    def busiest(self, role: str) -> str:
        """The worker of `role` claiming the most replies in its latest heartbeat."""

        def claimed(member_name: str) -> int:
            heartbeat = self.heartbeats.get(self._stack.member(member_name).instance_id)
            return -1 if heartbeat is None else len(heartbeat.reply_ids)

        return max(self.members(role), key=claimed)

    def logs(self, num_lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    async def wait_restarted(self, name: str, old_pid: int, timeout_s: float) -> None:
        """Waits until `name` runs as a process other than `old_pid` and is ready again."""
        deadline = time.monotonic() + timeout_s
        while self._stack.member(name).pid in (None, old_pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} was not started again within {timeout_s:.0f} s:\n{self.logs()}")
            await asyncio.sleep(0.2)
        await self._stack.wait_ready(name, timeout_s=max(1.0, deadline - time.monotonic()))

    async def wait_all_ready(self, timeout_s: float) -> None:
        """Every member ready, and a heartbeat from every worker whose engine is loaded (chat learns
        the served model from them)."""
        deadline = time.monotonic() + timeout_s
        for member in self._stack.members:
            await self._stack.wait_ready(member.name, timeout_s=max(1.0, deadline - time.monotonic()))
        workers = [m.instance_id for role in ("decode", "prefill") for m in self._stack.members_of(role)]
        while not all(w in self.heartbeats and self.heartbeats[w].is_engine_ready for w in workers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no ready heartbeat from every worker within {timeout_s:.0f} s")
            await asyncio.sleep(0.2)
