"""`tandem up`: the whole local stack as real processes — nats-server, redis-server and the
services (N decode and M prefill workers, one router, one relay, one or more chat instances) —
with prefixed logs, readiness, restarts with backoff, and an orderly stop on Ctrl-C.

It serves two models: the large one (the configured weights, or the embedded SmolLM2, in the
dtype) on those workers, and a small one on `small_decode_workers` more decode workers
("small-decode-0", ...; no prefill workers: they prefill locally) that keep the weights as int8
(small_model_quantization) from small_model_path, or the large model's file. Chat and router are
told both names (TANDEM_LARGE_MODEL, TANDEM_SMALL_MODEL) for `auto` and the pools' fallbacks.

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
"redis", and "decode", "prefill", "chat" when there is one), else its instance id ("decode-0",
"decode-1"). Each service instance has its own instance id, HTTP port and (workers) gRPC port,
kept across its restarts: chat instance i listens on chat_port + i (each checked free at start),
the others take free ports, and decode workers' UCX listeners a free port each. Servers restart on
the same port with the same data directory: JetStream's store and Redis's append-only file
survive a restart.

Both servers require a login (tandem.devstack.servers): each service gets its role's bus user, the
Redis password and the internal shared secret in its environment; the stack's own URLs carry the
operator's login for tools, and <work folder>/operator.env holds it as settings (TANDEM_NATS_USER,
...). A new `tandem up` makes a new set; nothing outlives the stack's work folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from tandem.bus.permissions import OPERATOR
from tandem.config import Settings
from tandem.devstack.members import Console, Member, StackConfig, check_chat_ports_free, dev_api_keys, service_member
from tandem.devstack.proc import ChildProcess, describe_exit
from tandem.devstack.secrets import env_file_text, write_private
from tandem.devstack.servers import EmbeddedServer, start_nats, start_redis
from tandem.errors import StartupError
from tandem.models.files import EMBEDDED_MODEL_NAME, open_model

__all__ = ["Console", "Member", "Stack", "StackConfig", "stack_config_from"]

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
# Settings the stack sets for each service itself; any other setting given to `tandem up` as a
# flag reaches every service as its variable.
_STACK_OWNED_SETTINGS = frozenset(
    {
        "host",
        "http_port",
        "grpc_port",
        "ucx_port",
        "instance_id",
        "nats_url",
        "redis_url",
        "api_keys",
        "decode_workers",
        "prefill_workers",
        "chat_instances",
        "nats_user",
        "nats_password",
        "redis_username",
        "redis_password",
        "internal_secret",
        "small_decode_workers",
        "small_model_path",
        "small_model_quantization",
        "large_model",
        "small_model",
    }
)
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
        nats = await self._start_server("nats", lambda port: start_nats(self._workdir, self._console.line, port=port))
        redis = await self._start_server("redis", lambda port: start_redis(self._workdir, self._console.line, port=port))
        self.nats_url, self.redis_url = nats.url, redis.url
        self._write_operator_file(nats, redis)
        for role, index, pool in self._config.planned():
            member = service_member(self._config, role, index, nats.address, redis.address, nats.secrets, self._console.line, pool)
            self._members.append(member)
        self._supervisors = [asyncio.create_task(self._supervise(m), name=f"supervise:{m.name}") for m in self._members]
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
                _send(child.pid, signal.SIGCONT)  # a SIGSTOPped member hears its SIGTERM too
                _send(child.pid, signal.SIGTERM)
            await asyncio.gather(*(self._reap(child) for child in running))
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        self._supervisors, self._members = [], []
        shutil.rmtree(self._workdir, ignore_errors=True)
        self._console.say("stopped; nothing left running")

    async def __aenter__(self) -> Stack:
        await self.start()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    # -- what drills use ---------------------------------------------------------------------

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
            _send(member.pid, signal.SIGCONT)  # a SIGSTOPped process would never act on the signal
            _send(member.pid, signum)
        try:
            await asyncio.wait_for(member.is_parked.wait(), self._config.stop_timeout_s)
        except TimeoutError:
            self._console.say(f"{name} did not stop in {self._config.stop_timeout_s:.0f} s; killing it")
            if member.pid is not None:
                _send(member.pid, signal.SIGKILL)
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

    def _write_operator_file(self, nats: EmbeddedServer, redis: EmbeddedServer) -> None:
        """The operator's login as settings, for tools run next to the stack (`set -a; . FILE`)."""
        operator = {
            "TANDEM_NATS_URL": nats.address,
            "TANDEM_NATS_USER": OPERATOR,
            "TANDEM_NATS_PASSWORD": nats.secrets.nats_passwords[OPERATOR],
            "TANDEM_REDIS_URL": redis.address,
            "TANDEM_REDIS_PASSWORD": redis.secrets.redis_password,
        }
        write_private(self._workdir / OPERATOR_FILE, env_file_text(operator))

    async def _start_server(self, role: str, start: Callable[[int | None], EmbeddedServer]) -> EmbeddedServer:
        server = await asyncio.to_thread(start, None)
        port = int(server.address.rsplit(":", 1)[1].split("/")[0])

        def relaunch() -> ChildProcess:  # the same port, so every client reconnects by itself
            return start(port).child

        member = Member(name=role, role=role, launch=relaunch, readyz_url=None, url=server.address, child=server.child)
        member.is_ready.set()
        self._members.append(member)
        self._console.say(f"{role} started (pid {server.pid}) at {server.address}")
        return server

    # -- supervision -------------------------------------------------------------------------

    async def _supervise(self, member: Member) -> None:
        """Keeps `member` running (a member already started, a server, is watched first), except
        while it is held."""
        while not self._stopping.is_set():
            if member.is_held:
                member.is_parked.set()
                await self._sleep_unless_woken(member, None)
                continue
            member.is_parked.clear()
            started_s = time.monotonic()
            try:
                if member.child is None or member.child.poll() is not None:
                    member.child = await asyncio.to_thread(member.launch)
                    self._console.say(f"{member.name} started (pid {member.child.pid})")
            except StartupError as exc:
                outcome = f"failed to start: {exc}"
            else:
                if member.is_held or self._stopping.is_set():  # held, or the stack stopping, while it started
                    _send(member.child.pid, signal.SIGTERM)
                outcome = await self._watch(member)
            if self._stopping.is_set():
                return
            if member.is_held:
                self._console.say(f"{member.name} {outcome}; held down until released")
                continue
            if time.monotonic() - started_s >= self._config.stable_after_s:
                member.num_quick_restarts = 0
            delay_s = BACKOFF_S[min(member.num_quick_restarts, len(BACKOFF_S) - 1)]
            member.num_quick_restarts += 1
            self._console.say(f"{member.name} {outcome}; restarting in {delay_s:.0f} s")
            await self._sleep_unless_woken(member, delay_s)

    async def _sleep_unless_woken(self, member: Member, delay_s: float | None) -> None:
        """Waits `delay_s` (None: for ever), cut short by a stop or by hold/release."""
        woken = asyncio.ensure_future(member.wake.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({woken, stopping}, timeout=delay_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            stopping.cancel()
            member.wake.clear()

    async def _watch(self, member: Member) -> str:
        """Waits for the member's exit, announcing readiness meanwhile; says how it ended."""
        assert member.child is not None
        readiness = None
        if member.readyz_url is None:
            member.is_ready.set()
        else:
            readiness = asyncio.create_task(self._await_ready(member))
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
                    _send(member.pid, signal.SIGKILL)

    def _announce(self) -> None:
        host, port = self._config.host, self._config.chat_port
        self._console.say(f"Tandem is up at http://{host}:{port}")
        chats = self.members_of("chat")
        if len(chats) > 1:
            for chat in chats:
                self._console.say(f"{chat.name} at {chat.url}")
        for key, api_key in self._config.api_keys.items():
            self._console.say(f"API key: {key}  (user {api_key.user_id}, tier {api_key.tier.value})")
        env = self._config.extra_env
        if "TANDEM_SMALL_MODEL" in env:
            small = f"{self._config.num_small_decode_workers} small-decode worker(s)"
            self._console.say(
                f'models: {env["TANDEM_LARGE_MODEL"]} (large), {env["TANDEM_SMALL_MODEL"]} (small, {small}); "auto" picks one'
            )
        self._console.say(f"try: curl -s http://{host}:{port}/readyz")
        routers = self.members_of("router")
        if routers:  # its port is a free one: top needs to be told
            self._console.say(f"watch: tandem top --router-url {routers[0].url} --chat-url http://{host}:{port}")
        self._console.say(f'internal clients: TANDEM_NATS_URL={self.nats_url} tandem generate --via-bus "Hello"')
        self._console.say(f"  (the operator's login, made for this run; as settings in {self._workdir / OPERATOR_FILE})")
        self._console.say("Ctrl-C stops everything")

    async def _reap(self, child: ChildProcess) -> None:
        try:
            await asyncio.wait_for(child.wait_async(), timeout=self._config.stop_timeout_s)
        except TimeoutError:
            self._console.say(f"{child.name} did not stop in {self._config.stop_timeout_s:.0f} s; killing it")
            child.process.kill()
            await child.wait_async()


def _send(pid: int, signum: int) -> None:
    """A signal to a child that may have exited a moment ago (its pid is not reaped, so not reused)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def stack_config_from(settings: Settings, chat_port: int | None, flags: dict[str, str] | None = None) -> StackConfig:
    """`flags`: the settings given to `tandem up` as flags (name -> value as typed); each reaches
    every service as its TANDEM_ variable, except those the stack sets per member."""
    extra_env: dict[str, str] = {"TANDEM_LOG_LEVEL": settings.log_level}
    if settings.model_path is not None:
        extra_env["TANDEM_MODEL_PATH"] = str(settings.model_path)
    for name, value in (flags or {}).items():
        if name not in _STACK_OWNED_SETTINGS:
            extra_env[f"TANDEM_{name.upper()}"] = str(value)
    small_worker_env: dict[str, str] = {}
    if settings.small_decode_workers:
        pools = model_pools(settings)
        extra_env.update({"TANDEM_LARGE_MODEL": pools.large, "TANDEM_SMALL_MODEL": pools.small})
        small_worker_env = {"TANDEM_QUANTIZATION": settings.small_model_quantization, "TANDEM_SERVED_MODEL_NAME": pools.small}
        small_path = settings.small_model_path or settings.model_path
        if small_path is not None:
            small_worker_env["TANDEM_MODEL_PATH"] = str(small_path)
    return StackConfig(
        host=settings.host,
        chat_port=settings.http_port_for("chat") if chat_port is None else chat_port,
        api_keys=settings.api_keys or dev_api_keys(),
        extra_env=extra_env,
        num_decode_workers=settings.decode_workers,
        num_prefill_workers=settings.prefill_workers,
        num_chat_instances=settings.chat_instances,
        num_small_decode_workers=settings.small_decode_workers,
        small_worker_env=small_worker_env,
    )


@dataclass(frozen=True)
class ModelNames:
    large: str
    small: str


def model_pools(settings: Settings) -> ModelNames:
    """The served ids of the two models `tandem up` serves: large_model and small_model when set,
    else named as a worker names its model (tandem.models.files): the served_model_name or the
    file's, and the small one's file name with its quantization ("SmolLM2-135M-Instruct" and
    "SmolLM2-135M-Instruct-int8" by default). Raises StartupError when both would be one model."""
    large = settings.large_model or settings.served_model_name or _file_model_name(settings.model_path)
    small = settings.small_model
    if not small:
        small = large if settings.small_model_path is None else _file_model_name(settings.small_model_path)
        if settings.small_model_quantization != "none":
            small = f"{small}-{settings.small_model_quantization}"
    if small == large:
        raise StartupError(
            f"the small model would be {large} again (the same weights, not quantized): set TANDEM_SMALL_MODEL_PATH, "
            "TANDEM_SMALL_MODEL_QUANTIZATION=int8, or TANDEM_SMALL_DECODE_WORKERS=0 for one model"
        )
    return ModelNames(large=large, small=small)


def _file_model_name(path: Path | None) -> str:
    """The served id a worker derives from `path` (None: the embedded model); a path that is no model fails here."""
    if path is None:
        return EMBEDDED_MODEL_NAME
    return open_model(path).name
