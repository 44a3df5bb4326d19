"""`tandem up`: the whole local stack as real processes — nats-server, redis-server and the five
services — with prefixed logs, readiness, restarts with backoff, and an orderly stop on Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tandem.config import DEFAULT_GRPC_PORTS, ApiKey, Settings, Tier
from tandem.devstack.proc import ChildProcess, describe_exit, free_port
from tandem.devstack.servers import EmbeddedServer, start_nats, start_redis
from tandem.errors import StartupError

SERVICE_ROLES = ("router", "relay", "prefill", "decode", "chat")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


@dataclass(frozen=True)
class StackConfig:
    host: str
    chat_port: int
    api_keys: dict[str, ApiKey]
    extra_env: dict[str, str]  # passed to every service (model path, log level, ...)
    ready_timeout_s: float = 300.0
    stop_timeout_s: float = 10.0
    stable_after_s: float = 30.0  # a member that ran this long restarts from the first backoff step


class Console:
    """Prefixed, line-atomic output: `name | text`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def line(self, name: str, text: str) -> None:
        with self._lock:
            sys.stdout.write(f"{name:<7}| {text}\n")
            sys.stdout.flush()

    def say(self, text: str) -> None:
        self.line("up", text)


@dataclass
class Member:
    """One supervised process. `launch` starts it and returns once it may be polled for readiness."""

    name: str
    launch: Callable[[], ChildProcess]
    readyz_url: str | None  # None: ready as soon as launch returns
    child: ChildProcess | None = None
    is_ready: asyncio.Event = field(default_factory=asyncio.Event)
    num_quick_restarts: int = 0


def api_keys_spec(keys: dict[str, ApiKey]) -> str:
    return ",".join(f"{key}={api_key.user_id}:{api_key.tier.value}" for key, api_key in keys.items())


def dev_api_keys() -> dict[str, ApiKey]:
    return {f"tdm-dev-{secrets.token_urlsafe(12)}": ApiKey(user_id="dev", tier=Tier.PLUS)}


class Stack:
    def __init__(self, config: StackConfig, console: Console | None = None) -> None:
        self._config = config
        self._console = console or Console()
        self._workdir = Path(tempfile.mkdtemp(prefix="tandem-up-"))
        self._members: list[Member] = []
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._num_signals = 0

    async def run(self) -> int:
        """Runs until SIGINT/SIGTERM; returns the exit status."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal)
        self._console.say(f"starting the local stack (pid {os.getpid()}) in {self._workdir}")
        try:
            return await self._run()
        finally:
            self._stopping.set()
            await self._stop_all()
            await asyncio.gather(*self._supervisors, return_exceptions=True)
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._console.say("stopped; nothing left running")

    def _on_signal(self) -> None:
        self._num_signals += 1
        if self._num_signals == 1:
            self._console.say("stopping (Ctrl-C again to kill at once)")
            self._stopping.set()
        else:
            for member in self._members:
                if member.child is not None and member.child.poll() is None:
                    member.child.process.kill()

    async def _run(self) -> int:
        nats = await self._start_server("nats", lambda port: start_nats(self._workdir, self._console.line, port=port))
        redis = await self._start_server("redis", lambda port: start_redis(self._workdir, self._console.line, port=port))
        for role in SERVICE_ROLES:
            self._members.append(self._service(role, nats.url, redis.url))
        self._supervisors = [asyncio.create_task(self._supervise(m), name=f"supervise:{m.name}") for m in self._members]
        if not await self._wait_all_ready():
            return 1
        self._announce(nats.url)
        await self._stopping.wait()
        return 0

    async def _start_server(self, name: str, start: Callable[[int | None], EmbeddedServer]) -> EmbeddedServer:
        server = await asyncio.to_thread(start, None)
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])

        def relaunch() -> ChildProcess:  # the same port, so every client reconnects by itself
            return start(port).child

        member = Member(name=name, launch=relaunch, readyz_url=None, child=server.child)
        member.is_ready.set()
        self._members.append(member)
        self._console.say(f"{name} started (pid {server.pid}) at {server.url}")
        return server

    def _service(self, role: str, nats_url: str, redis_url: str) -> Member:
        http_port = self._config.chat_port if role == "chat" else free_port(self._config.host)
        env = {
            **os.environ,
            **self._config.extra_env,
            "PYTHONUNBUFFERED": "1",
            "TANDEM_HOST": self._config.host,
            "TANDEM_HTTP_PORT": str(http_port),
            "TANDEM_NATS_URL": nats_url,
            "TANDEM_REDIS_URL": redis_url,
            "TANDEM_API_KEYS": api_keys_spec(self._config.api_keys),
            "TANDEM_INSTANCE_ID": f"{role}-0",  # kept across restarts: the router sees the same worker come back
        }
        if role in DEFAULT_GRPC_PORTS:
            env["TANDEM_GRPC_PORT"] = str(free_port(self._config.host))
        child = ChildProcess(role, [sys.executable, "-m", f"services.{role}"], env=env, on_line=self._console.line)

        def launch() -> ChildProcess:
            child.start()
            return child

        return Member(name=role, launch=launch, readyz_url=f"http://{self._config.host}:{http_port}/readyz")

    async def _supervise(self, member: Member) -> None:
        """Keeps `member` running: a member already started (a server) is watched first."""
        while not self._stopping.is_set():
            started_s = time.monotonic()
            try:
                if member.child is None or member.child.poll() is not None:
                    member.child = await asyncio.to_thread(member.launch)
                    self._console.say(f"{member.name} started (pid {member.child.pid})")
            except StartupError as exc:
                outcome = f"failed to start: {exc}"
            else:
                outcome = await self._watch(member)
            if self._stopping.is_set():
                return
            if time.monotonic() - started_s >= self._config.stable_after_s:
                member.num_quick_restarts = 0
            delay_s = BACKOFF_S[min(member.num_quick_restarts, len(BACKOFF_S) - 1)]
            member.num_quick_restarts += 1
            self._console.say(f"{member.name} {outcome}; restarting in {delay_s:.0f} s")
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=delay_s)
            except TimeoutError:
                pass

    async def _watch(self, member: Member) -> str:
        """Waits for the member's exit, announcing readiness meanwhile; says how it ended."""
        assert member.child is not None
        readiness = asyncio.create_task(self._await_ready(member)) if member.readyz_url else None
        try:
            returncode = await member.child.wait_async()
        finally:
            member.is_ready.clear()
            if readiness is not None:
                readiness.cancel()
        return f"exited ({describe_exit(returncode)})"

    async def _await_ready(self, member: Member) -> None:
        assert member.readyz_url is not None
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                try:
                    if (await client.get(member.readyz_url)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        member.is_ready.set()
        self._console.say(f"{member.name} ready")

    async def _wait_all_ready(self) -> bool:
        everyone = asyncio.gather(*(m.is_ready.wait() for m in self._members))
        stopping = asyncio.ensure_future(self._stopping.wait())
        either: set[asyncio.Future[Any]] = {everyone, stopping}
        done, _ = await asyncio.wait(either, timeout=self._config.ready_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if everyone in done:
            return True
        everyone.cancel()
        if not self._stopping.is_set():
            waiting = [m for m in self._members if not m.is_ready.is_set()]
            self._console.say(f"not ready after {self._config.ready_timeout_s:.0f} s: {', '.join(m.name for m in waiting)}; stopping")
        return False

    def _announce(self, nats_url: str) -> None:
        host, port = self._config.host, self._config.chat_port
        self._console.say(f"Tandem is up at http://{host}:{port}")
        for key, api_key in self._config.api_keys.items():
            self._console.say(f"API key: {key}  (user {api_key.user_id}, tier {api_key.tier.value})")
        self._console.say(f"try: curl -s http://{host}:{port}/readyz")
        self._console.say(f'internal clients: TANDEM_NATS_URL={nats_url} tandem generate --via-bus "Hello"')
        self._console.say("Ctrl-C stops everything")

    async def _stop_all(self) -> None:
        """Services first (they drain), then redis and nats; SIGKILL whatever outlives the timeout."""
        services = [m for m in self._members if m.readyz_url is not None]
        servers = [m for m in self._members if m.readyz_url is None]
        for group in (services, servers):
            running = [m.child for m in group if m.child is not None and m.child.poll() is None]
            for child in running:
                child.process.terminate()
            await asyncio.gather(*(self._reap(child) for child in running))

    async def _reap(self, child: ChildProcess) -> None:
        try:
            await asyncio.wait_for(child.wait_async(), timeout=self._config.stop_timeout_s)
        except TimeoutError:
            self._console.say(f"{child.name} did not stop in {self._config.stop_timeout_s:.0f} s; killing it")
            child.process.kill()
            await child.wait_async()


def stack_config_from(settings: Settings, chat_port: int | None) -> StackConfig:
    extra_env: dict[str, str] = {"TANDEM_LOG_LEVEL": settings.log_level}
    if settings.model_path is not None:
        extra_env["TANDEM_MODEL_PATH"] = str(settings.model_path)
    return StackConfig(
        host=settings.host,
        chat_port=settings.http_port_for("chat") if chat_port is None else chat_port,
        api_keys=settings.api_keys or dev_api_keys(),
        extra_env=extra_env,
    )
