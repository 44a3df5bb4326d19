"""The `__main__` of every service: settings, apps, sockets, serve until SIGTERM, exit 0 (1 for a
runtime that failed); and the port checks that make a bad setting fail at start in one line.

Two servers share the event loop: the service's own on its HTTP port and the ops app on the ops
port (tandem.runtime.app.ops_app), each with its own connection limit, so a flood on the service's
port never starves a probe. The ops server stops after the service's has drained: /readyz
answers 503 while it drains, rather than refusing connections."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import signal
import socket
import sys
from collections.abc import Callable, Generator
from types import FrameType
from typing import Literal, NoReturn

import uvicorn
from fastapi import FastAPI

from tandem.config import Settings, load_settings
from tandem.errors import StartupError
from tandem.runtime.affinity import pin_process
from tandem.runtime.collector import settle_started_service
from tandem.runtime.http_limits import SPARE_CONNECTIONS, HttpLimits, default_max_connections, protocol_with
from tandem.runtime.ops_port import ops_port_for
from tandem.runtime.runtime import Runtime

log = logging.getLogger(__name__)


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


class _OpsServer(uvicorn.Server):
    """The ops port's server: the service's server owns the signals, and run_service stops this
    one once that one is done."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class _DrainingServer(uvicorn.Server):
    """A uvicorn server that tells the app's runtime it is stopping as soon as the signal comes
    (Runtime.begin_draining, on the event loop), before it waits for the open requests."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime | None) -> None:
        super().__init__(config)
        self._runtime = runtime

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        settle_started_service()  # the cyclic collector: what it holds now frozen, passes timed

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._runtime is not None and not self.should_exit:
            with contextlib.suppress(RuntimeError):  # no loop running yet: the lifespan's stop drains
                asyncio.get_running_loop().call_soon_threadsafe(self._runtime.begin_draining)
        super().handle_exit(sig, frame)


def http_limits_for(role: str, settings: Settings) -> HttpLimits:
    return HttpLimits(
        max_connections=settings.http_max_connections or default_max_connections(role, settings.max_streams),
        header_timeout_s=settings.http_header_timeout_s,
        body_timeout_s=settings.http_body_timeout_s,
    )


def fail(role: str, message: str) -> NoReturn:
    print(f"tandem {role}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def run_service(role: str, build_app: Callable[[Settings], FastAPI], settings: Settings | None = None) -> NoReturn:
    """The `__main__` of every service: settings, apps, sockets, serve until SIGTERM, exit 0.
    `settings`: already read (`tandem serve`); None reads this process's flags, then the
    environment and the toml file."""
    try:
        if settings is None:
            settings = load_settings(sys.argv[1:], prog=f"python -m services.{role}")
        logging.basicConfig(
            level=settings.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stdout,
        )
        pin_process(settings.cpus)  # before the app starts its threads
        ops_port = ops_port_for(settings, role)
        ops_sock = bind_port(settings.host, ops_port, "TANDEM_OPS_PORT")
        if ops_port == 0:  # heartbeats carry the port taken
            settings = settings.model_copy(update={"ops_port": ops_sock.getsockname()[1]})
        app = build_app(settings)
        sock = bind_port(settings.host, settings.http_port_for(role), "TANDEM_HTTP_PORT")
        sock.listen(settings.http_backlog)
        ops_sock.listen(settings.http_backlog)
    except StartupError as exc:
        fail(role, str(exc))
    signal.signal(signal.SIGTERM, _ignore_signal)
    signal.signal(signal.SIGINT, _ignore_signal)
    runtime = getattr(app.state, "runtime", None)  # every service's (tandem.runtime.create_app)
    limits = http_limits_for(role, settings)
    server = _DrainingServer(_server_config(app, settings, limits, lifespan="on"), runtime)
    # The service's timeouts; room for probes and scrapes, whatever the service's own limit.
    ops_limits = dataclasses.replace(limits, max_connections=SPARE_CONNECTIONS)
    ops_server = _OpsServer(_server_config(app.state.ops_app, settings, ops_limits, lifespan="off"))
    log.info("%s listening on http://%s:%d", role, settings.host, sock.getsockname()[1])
    log.info("%s ops (health, readiness, metrics, API docs) on http://%s:%d", role, settings.host, ops_sock.getsockname()[1])

    async def serve_both() -> None:
        ops = asyncio.create_task(ops_server.serve(sockets=[ops_sock]), name="ops-server")
        try:
            await server.serve(sockets=[sock])
        finally:
            ops_server.should_exit = True
            await ops

    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        runner.run(serve_both())
    # A worker's runtime says 1 when it stopped because it failed.
    exit_code = runtime.exit_code if runtime is not None else 0
    raise SystemExit(exit_code if server.started else 1)


def _server_config(app: FastAPI, settings: Settings, limits: HttpLimits, *, lifespan: Literal["on", "off"]) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=max(1, int(settings.shutdown_timeout_s / 2)),
        lifespan=lifespan,
        http=protocol_with(limits),
        backlog=settings.http_backlog,
    )
