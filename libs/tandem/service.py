"""What every Tandem process has: a NATS connection, a heartbeat, /healthz /readyz /metrics,
drain, and a clean exit on SIGTERM. A service's own module only adds its logic."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NoReturn

import redis.asyncio as aioredis
import uvicorn
from fastapi import APIRouter, FastAPI, Response
from google.protobuf.message import Message

from tandem import __version__, metrics
from tandem.bus import Bus, BusConfig, encode, subjects
from tandem.config import Settings, load_settings
from tandem.errors import StartupError
from tandem.v1.worker_pb2 import ServiceHeartbeat

log = logging.getLogger(__name__)

ReadinessCheck = Callable[[], Awaitable[bool]]
HeartbeatBuilder = Callable[[ServiceHeartbeat], Message]


@dataclass(frozen=True)
class RuntimeConfig:
    role: str
    instance_id: str
    http_url: str
    nats_url: str
    redis_url: str | None  # None: this service does not use Redis
    heartbeat_interval_s: float

    @classmethod
    def from_settings(cls, role: str, settings: Settings, *, uses_redis: bool) -> RuntimeConfig:
        return cls(
            role=role,
            instance_id=settings.instance_id_for(role),
            http_url=f"http://{settings.reachable_host()}:{settings.http_port_for(role)}",
            nats_url=settings.nats_url,
            redis_url=settings.redis_url if uses_redis else None,
            heartbeat_interval_s=settings.heartbeat_interval_s,
        )


class Runtime:
    """Owns the long-lived clients of one process and answers its readiness."""

    def __init__(self, config: RuntimeConfig, heartbeat: HeartbeatBuilder | None = None) -> None:
        self.config = config
        self.bus = Bus(BusConfig(url=config.nats_url, name=config.instance_id))
        self.redis = aioredis.from_url(config.redis_url, socket_timeout=1.0) if config.redis_url else None
        self.is_draining = False
        self._checks: dict[str, ReadinessCheck] = {}
        self._build_heartbeat = heartbeat or (lambda base: base)
        self._started_unix_ms = int(time.time() * 1000)
        self._heartbeat_task: asyncio.Task[None] | None = None

    def add_check(self, name: str, check: ReadinessCheck) -> None:
        self._checks[name] = check

    async def start(self) -> None:
        metrics.SERVICE_INFO.info({"role": self.config.role, "instance": self.config.instance_id, "version": __version__})
        self.bus.start()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    async def stop(self) -> None:
        self.is_draining = True
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
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
            sent_unix_ms=int(time.time() * 1000),
            interval_s=self.config.heartbeat_interval_s,
        )

    async def _heartbeat_loop(self) -> None:
        client = await self.bus.wait_connected()
        subject = subjects.heartbeat(self.config.role, self.config.instance_id)
        while True:
            if client.is_connected:
                is_ready = all((await self.readiness()).values())
                await client.publish(subject, encode(self._build_heartbeat(self.service_heartbeat(is_ready))))
                metrics.HEARTBEATS_SENT.inc()
            await asyncio.sleep(self.config.heartbeat_interval_s)


def health_router(runtime: Runtime) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "role": runtime.config.role}

    @router.get("/readyz")
    async def readyz(response: Response) -> dict[str, object]:
        checks = await runtime.readiness()
        is_ready = all(checks.values())
        response.status_code = 200 if is_ready else 503
        return {"ready": is_ready, "checks": checks}

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return router


def create_app(
    runtime: Runtime,
    *,
    routers: Sequence[APIRouter] = (),
    on_start: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> FastAPI:
    """A FastAPI app whose lifespan owns the runtime; `on_start`/`on_stop` add the service's own."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        if on_start is not None:
            await on_start()
        try:
            yield
        finally:
            runtime.is_draining = True
            if on_stop is not None:
                await on_stop()
            await runtime.stop()

    app = FastAPI(title=f"tandem {runtime.config.role}", version=__version__, lifespan=lifespan)
    app.include_router(health_router(runtime))
    for router in routers:
        app.include_router(router)
    return app


def bind_port(host: str, port: int, setting: str) -> socket.socket:
    """A bound TCP socket, or a StartupError naming the setting to change."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(f"port {port} on {host} is in use: stop what holds it or set {setting}") from None
        raise StartupError(f"cannot listen on {host}:{port} ({exc.strerror}): check TANDEM_HOST and {setting}") from None
    return sock


def check_port_free(host: str, port: int, setting: str) -> None:
    """For ports another library binds later (gRPC): fail at start, clearly, if it is taken."""
    bind_port(host, port, setting).close()


def _ignore_signal(signum: int, frame: object) -> None:
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; this handler makes that a no-op,
    # so a stopped service exits 0 instead of dying by the signal.
    pass


def fail(role: str, message: str) -> NoReturn:
    print(f"tandem {role}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def run_service(role: str, build_app: Callable[[Settings], FastAPI]) -> NoReturn:
    """The `__main__` of every service: settings, app, socket, serve until SIGTERM, exit 0."""
    try:
        settings = load_settings()
        logging.basicConfig(
            level=settings.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stdout,
        )
        app = build_app(settings)
        sock = bind_port(settings.host, settings.http_port_for(role), "TANDEM_HTTP_PORT")
        sock.listen(2048)
    except StartupError as exc:
        fail(role, str(exc))
    signal.signal(signal.SIGTERM, _ignore_signal)
    signal.signal(signal.SIGINT, _ignore_signal)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=settings.log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout_s / 2)),
            lifespan="on",
        )
    )
    log.info("%s listening on http://%s:%d", role, settings.host, sock.getsockname()[1])
    server.run(sockets=[sock])
    raise SystemExit(0 if server.started else 1)
