"""The stack the failure drills run against: nats-server and redis-server, a router, a relay,
decode and prefill workers and chat instances, each a real process with fixed ports and instance
ids, supervised like `tandem up` does (a member that exits is started again, servers on the same
port). The drills reach every member by name (`decode-0`, `prefill-0`, `relay-0`, `chat-1`,
`nats`, `redis`, ...) to signal it, and read the workers' heartbeats to find the busiest one."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx
import nats
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg

from tandem.bus import BadMessage, decode
from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.servers import start_nats, start_redis
from tandem.v1.worker_pb2 import WorkerHeartbeat

REPO = Path(__file__).resolve().parent.parent
API_KEY = "drill-key"
RESTART_DELAY_S = 0.5


@dataclass
class _Member:
    name: str
    start: Callable[[], ChildProcess]
    readyz_url: str | None  # None: a server, ready once started
    child: ChildProcess | None = None
    restarts: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class DrillStack:
    def __init__(
        self, decode_workers: int = 2, prefill_workers: int = 1, chat_instances: int = 2, extra_env: dict[str, str] | None = None
    ) -> None:
        self._counts = {"router": 1, "relay": 1, "prefill": prefill_workers, "decode": decode_workers, "chat": chat_instances}
        self._extra_env = extra_env or {}
        self._workdir = Path(tempfile.mkdtemp(prefix="tandem-drills-"))
        self._members: dict[str, _Member] = {}
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = False
        self._nc: Nats | None = None
        self.heartbeats: dict[str, WorkerHeartbeat] = {}
        self.chat_urls: list[str] = []
        self.api_key = API_KEY

    # -- lifecycle ----------------------------------------------------------------------------------

    async def __aenter__(self) -> DrillStack:
        nats_server = await asyncio.to_thread(start_nats, self._workdir)
        redis_server = await asyncio.to_thread(start_redis, self._workdir)
        nats_port = int(nats_server.url.rsplit(":", 1)[1])
        redis_port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
        self._add_server("nats", nats_server.child, lambda: start_nats(self._workdir, port=nats_port).child)
        self._add_server("redis", redis_server.child, lambda: start_redis(self._workdir, port=redis_port).child)
        for role, count in self._counts.items():
            for index in range(count):
                self._add_service(role, index, nats_server.url, redis_server.url)
        self._nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.5)
        await self._nc.subscribe("tandem.v1.heartbeat.*.*", cb=self._on_heartbeat)
        self._supervisors = [asyncio.create_task(self._supervise(m), name=f"supervise:{m.name}") for m in self._members.values()]
        await self.wait_all_ready(timeout_s=300.0)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stopping = True
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        if self._nc is not None:
            await self._nc.close()
        services = [m for m in self._members.values() if m.readyz_url is not None]
        servers = [m for m in self._members.values() if m.readyz_url is None]
        for group in (services, servers):
            await asyncio.gather(*(asyncio.to_thread(m.child.stop, 10.0) for m in group if m.child is not None))
        shutil.rmtree(self._workdir, ignore_errors=True)

    def _add_server(self, name: str, child: ChildProcess, restart: Callable[[], ChildProcess]) -> None:
        member = _Member(name, restart, None, child=child)
        member.ready.set()
        self._members[name] = member

    def _add_service(self, role: str, index: int, nats_url: str, redis_url: str) -> None:
        name = f"{role}-{index}"
        http_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        env.update(
            PYTHONUNBUFFERED="1",
            TANDEM_HOST="127.0.0.1",
            TANDEM_HTTP_PORT=str(http_port),
            TANDEM_NATS_URL=nats_url,
            TANDEM_REDIS_URL=redis_url,
            TANDEM_INSTANCE_ID=f"{name}-drill",
            TANDEM_API_KEYS=f"{API_KEY}=driller:plus",
            TANDEM_STORE="sqlite",
            TANDEM_SQLITE_PATH=str(self._workdir / "conversations.db"),
        )
        if role in ("prefill", "decode"):
            env["TANDEM_GRPC_PORT"] = str(free_port())
            env["TANDEM_UCX_PORT"] = str(free_port())
        env.update(self._extra_env)
        if role == "chat":
            self.chat_urls.append(f"http://127.0.0.1:{http_port}")

        def start() -> ChildProcess:
            child = ChildProcess(name, [sys.executable, "-m", f"services.{role}"], env=env, cwd=str(REPO))
            child.start()
            return child

        self._members[name] = _Member(name, start, f"http://127.0.0.1:{http_port}/readyz")

    async def _supervise(self, member: _Member) -> None:
        while not self._stopping:
            if member.child is None or member.child.poll() is not None:
                member.child = await asyncio.to_thread(member.start)
                member.ready.set() if member.readyz_url is None else member.ready.clear()
            readiness = asyncio.create_task(self._await_ready(member)) if member.readyz_url else None
            try:
                await member.child.wait_async()
            finally:
                member.ready.clear()
                if readiness is not None:
                    readiness.cancel()
            if self._stopping:
                return
            member.restarts += 1
            await asyncio.sleep(RESTART_DELAY_S)

    async def _await_ready(self, member: _Member) -> None:
        assert member.readyz_url is not None
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                try:
                    if (await client.get(member.readyz_url)).status_code == 200:
                        member.ready.set()
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)

    async def _on_heartbeat(self, msg: Msg) -> None:
        role = msg.subject.split(".")[-2]
        if role not in ("decode", "prefill"):
            return
        try:
            heartbeat = decode(msg.data, WorkerHeartbeat)
        except BadMessage:
            return
        self.heartbeats[heartbeat.service.instance_id] = heartbeat

    # -- what drills do -----------------------------------------------------------------------------

    def members(self, role: str) -> list[str]:
        return [name for name in self._members if name.rsplit("-", 1)[0] == role]

    def service_members(self) -> list[str]:
        """Every service, in the order a rolling restart goes through them."""
        order = ("router", "relay", "prefill", "decode", "chat")
        return [name for role in order for name in self.members(role)]

    def pid(self, name: str) -> int:
        child = self._members[name].child
        if child is None:
            raise LookupError(f"{name} is not running")
        return child.pid

    def signal(self, name: str, signum: int) -> int:
        """Sends `signum` to member `name`; returns its pid."""
        pid = self.pid(name)
        os.kill(pid, signum)
        return pid

    def busiest(self, role: str) -> str:
        """The worker of `role` claiming the most replies in its latest heartbeat."""
        names = self.members(role)

        def claimed(name: str) -> int:
            heartbeat = self.heartbeats.get(f"{name}-drill")
            if heartbeat is None:
                return -1
            return max(len(heartbeat.reply_ids), heartbeat.running.paid + heartbeat.running.free + heartbeat.running.background)

        return max(names, key=claimed)

    def logs(self, num_lines: int = 40) -> str:
        return "\n".join(f"--- {m.name}\n{m.child.recent_output(num_lines)}" for m in self._members.values() if m.child is not None)

    async def wait_restarted(self, name: str, timeout_s: float) -> None:
        """Waits until `name` has exited and its next process is ready."""
        member = self._members[name]
        restarts = member.restarts
        deadline = time.monotonic() + timeout_s
        while member.restarts == restarts or not member.ready.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} was not back within {timeout_s:.0f} s:\n{self.logs()}")
            await asyncio.sleep(0.2)

    async def wait_all_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(m.ready.is_set() for m in self._members.values()):
            if time.monotonic() > deadline:
                waiting = [m.name for m in self._members.values() if not m.ready.is_set()]
                raise TimeoutError(f"not ready after {timeout_s:.0f} s: {', '.join(waiting)}\n{self.logs()}")
            await asyncio.sleep(0.2)
        # Chat learns the served model from worker heartbeats: wait for one from every worker.
        workers = [f"{name}-drill" for role in ("decode", "prefill") for name in self.members(role)]
        while not all(w in self.heartbeats and self.heartbeats[w].is_engine_ready for w in workers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no ready heartbeat from every worker within {timeout_s:.0f} s")
            await asyncio.sleep(0.2)
