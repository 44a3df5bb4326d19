"""One process's long-lived clients (NATS, Redis), its readiness checks, drain flag and heartbeat."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from google.protobuf.message import Message
from nats.aio.client import Client
from nats.aio.msg import Msg
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from tandem import __version__, metrics
from tandem.bus import Bus, BusConfig, encode, subjects
from tandem.bus.events import now_ms
from tandem.bus.permissions import inbox_prefix
from tandem.config import Settings
from tandem.redis_sentinel import SentinelTarget, master_client, sentinel_target
from tandem.runtime.loop_lag import watch_loop_lag
from tandem.runtime.ops_port import ops_url
from tandem.tls import TlsSettings
from tandem.v1.worker_pb2 import ServiceHeartbeat

log = logging.getLogger(__name__)
REDIS_COMMAND_TIMEOUT_S = 1.0
REDIS_POOL_WAIT_S = 2.0  # a command waits this long for a free connection, then fails (a RedisError)

ReadinessCheck = Callable[[], Awaitable[bool]]
HeartbeatBuilder = Callable[[ServiceHeartbeat], Message]


@dataclass(frozen=True)
class RuntimeConfig:
    role: str
    instance_id: str
    http_url: str  # its ops port's: /healthz, /readyz and /metrics (tandem.runtime.ops_port)
    nats_url: str
    redis_url: str | None  # None: this service does not use Redis
    heartbeat_interval_s: float
    redis_max_connections: int = 64
    nats_user: str = ""  # this instance's bus user (a role's, in containers); empty: none (or the URL's)
    nats_password: str = field(default="", repr=False)
    redis_username: str = ""
    redis_password: str = field(default="", repr=False)
    redis_sentinel: SentinelTarget | None = None  # find the primary through these sentinels (redis_url: its db)
    tls: TlsSettings | None = None  # this process's CA and certificate (TANDEM_TLS_*); none: the bus in clear

    @classmethod
    def from_settings(cls, role: str, settings: Settings, *, uses_redis: bool) -> RuntimeConfig:
        return cls(
            role=role,
            instance_id=settings.instance_id_for(role),
            http_url=ops_url(settings, role),
            nats_url=settings.nats_url,
            redis_url=settings.redis_url if uses_redis else None,
            heartbeat_interval_s=settings.heartbeat_interval_s,
            redis_max_connections=settings.redis_max_connections,
            nats_user=settings.nats_user,
            nats_password=settings.nats_password.get_secret_value(),
            redis_username=settings.redis_username,
            redis_password=settings.redis_password.get_secret_value(),
            redis_sentinel=sentinel_target(
                settings.redis_sentinels, settings.redis_sentinel_master, settings.redis_sentinel_password.get_secret_value()
            ),
            tls=TlsSettings(),
        )


def redis_login(username: str, password: str) -> dict[str, str]:
    """The keyword arguments a redis client logs in with: only those set, so that a URL's own
    user and password still apply when the settings name none."""
    login = {"username": username, "password": password}
    return {name: value for name, value in login.items() if value}


def short_command_client(url: str, max_connections: int, login: dict[str, str], sentinel: SentinelTarget | None = None) -> aioredis.Redis:
    """A client for short commands over at most `max_connections` connections: a command waits
    for a free one rather than opening more (a blocking read needs a client of its own, and
    tandem.tokenlog's tail logs in as this one does).

    A command that finds its pooled connection closed (Redis restarted since it was last used)
    runs once more on a new connection, instead of failing once per connection the pool holds. A
    timeout is not retried: the command may have run.

    With `sentinel`, every new connection goes to the primary the sentinels name (`url` gives the
    database): after a failover the retry finds the new one once they have promoted it."""
    limits: dict[str, Any] = {
        "max_connections": max_connections,
        "timeout": REDIS_POOL_WAIT_S,
        "socket_timeout": REDIS_COMMAND_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    }
    if sentinel is not None:
        return master_client(sentinel, url, **limits, **login)
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(url, **limits, **login))


class Runtime:
    """Owns the long-lived clients of one process and answers its readiness."""

    def __init__(self, config: RuntimeConfig, heartbeat: HeartbeatBuilder | None = None) -> None:
        self.config = config
        self.bus = Bus(
            BusConfig(
                url=config.nats_url,
                name=config.instance_id,
                user=config.nats_user,
                password=config.nats_password,
                inbox_prefix=inbox_prefix(config.role, config.instance_id),
                tls=config.tls,
            )
        )
        login = redis_login(config.redis_username, config.redis_password)
        self.redis = (
            short_command_client(config.redis_url, config.redis_max_connections, login, config.redis_sentinel) if config.redis_url else None
        )
        self.is_draining = False
        self.exit_code = 0  # what the process exits with once stopped; fail() makes it 1
        self._checks: dict[str, ReadinessCheck] = {}
        self._on_drain: list[Callable[[], None]] = []
        self._build_heartbeat = heartbeat or (lambda base: base)
        self._started_unix_ms = now_ms()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self.bus.on_connect(self._answer_pings)

    async def _answer_pings(self, client: Client) -> None:
        async def pong(msg: Msg) -> None:
            if msg.reply:
                await msg.respond(b"")

        await client.subscribe(subjects.ping(self.config.instance_id), cb=pong)

    def add_check(self, name: str, check: ReadinessCheck) -> None:
        self._checks[name] = check

    def on_drain(self, callback: Callable[[], None]) -> None:
        """`callback()` runs once, on the event loop, when this process starts to stop (SIGTERM),
        before the HTTP server waits for its open requests: a chat instance ends its streams
        then, so their clients resume elsewhere instead of being cut at the grace's end."""
        self._on_drain.append(callback)

    def begin_draining(self) -> None:
        if self.is_draining:
            return
        self.is_draining = True
        log.info("%s %s is stopping: draining", self.config.role, self.config.instance_id)
        for callback in self._on_drain:
            callback()

    async def start(self) -> None:
        metrics.SERVICE_INFO.info({"role": self.config.role, "instance": self.config.instance_id, "version": __version__})
        self.bus.start()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        self._lag_task = asyncio.create_task(watch_loop_lag(), name="loop-lag")

    def fail(self, reason: str) -> None:
        """This process cannot serve any more: it stops (as on SIGTERM) and exits 1, so that its
        supervisor starts a fresh one."""
        log.error("%s %s failed, stopping: %s", self.config.role, self.config.instance_id, reason)
        self.exit_code = 1
        signal.raise_signal(signal.SIGTERM)  # the server's own handler starts the shutdown

    async def stop(self) -> None:
        self.is_draining = True
        for task in (self._heartbeat_task, self._lag_task):
            if task is not None:
                task.cancel()
        if self.bus.is_connected:  # a last word: draining, not ready, and (a worker) holding no reply any more
            try:
                await self._send_heartbeat(self.bus.client)
            except Exception:
                log.exception("the last heartbeat was not sent")
        await self.bus.close()
        if self.redis is not None:
            await self.redis.aclose()

    async def readiness(self) -> dict[str, bool]:
        report = {"nats": self.bus.is_connected, "not_draining": not self.is_draining}
        if self.redis is not None:
            report["redis"] = await self._redis_answers()
        for name, check in self._checks.items():
            try:
                report[name] = await check()
            except Exception:  # a probe that raises is a failing check, never a dead heartbeat
                log.exception("readiness check %r raised", name)
                report[name] = False
        metrics.IS_NATS_CONNECTED.set(report["nats"])
        metrics.IS_READY.set(all(report.values()))
        return report

    async def _redis_answers(self) -> bool:
        assert self.redis is not None
        try:
            return bool(await self.redis.ping())
        except (aioredis.RedisError, OSError):
            return False

    def service_heartbeat(self, is_ready: bool) -> ServiceHeartbeat:
        return ServiceHeartbeat(
            role=self.config.role,
            instance_id=self.config.instance_id,
            version=__version__,
            http_url=self.config.http_url,
            is_ready=is_ready,
            is_draining=self.is_draining,
            started_unix_ms=self._started_unix_ms,
            sent_unix_ms=now_ms(),
            interval_s=self.config.heartbeat_interval_s,
        )

    async def _heartbeat_loop(self) -> None:
        client = await self.bus.wait_connected()
        subject = subjects.heartbeat(self.config.role, self.config.instance_id)
        while True:
            if client.is_connected:
                await self._send_heartbeat(client, subject)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _send_heartbeat(self, client: Client, subject: str | None = None) -> None:
        is_ready = all((await self.readiness()).values())
        heartbeat = self._build_heartbeat(self.service_heartbeat(is_ready))
        await client.publish(subject or subjects.heartbeat(self.config.role, self.config.instance_id), encode(heartbeat))
        metrics.HEARTBEATS_SENT.inc()
