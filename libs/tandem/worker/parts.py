"""What every worker is made of, built in dependency order: the engine host first, then the
heartbeat that reports its load and its replies, the runtime that sends that heartbeat, and the
gRPC control server that answers Stats with it. Prefill and decode workers add their own parts
around these.

Also what every worker does at the end of its life: on SIGTERM it drains (takes no new work, lets
the replies it holds finish for up to drain_timeout_s, then gives up the rest, which the relay
continues elsewhere) and exits 0; when its host fails (engine thread dead, token events that
cannot be published) it stops at once and exits 1, so that its supervisor restarts it."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI

from tandem.config import Settings
from tandem.models.files import open_model
from tandem.runtime import Runtime, RuntimeConfig, check_port_free, create_app
from tandem.worker.admission import TtftTargets
from tandem.worker.control import ControlServer, WorkerControl
from tandem.worker.engine_metrics import EngineMetrics, HandoffMetrics
from tandem.worker.engine_spec import EngineSpec
from tandem.worker.heartbeat import WorkerHeartbeats
from tandem.worker.host import EngineHost
from tandem.worker.internal_grpc import check_internal_secret

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerParts:
    runtime: Runtime
    host: EngineHost
    control: ControlServer
    drain_timeout_s: float
    handoff_metrics: HandoffMetrics

    def app(self, on_start: Callable[[], Awaitable[None]], on_stop: Callable[[], Awaitable[None]]) -> FastAPI:
        """The worker's app: the control server runs around the worker's own start and stop; a
        failed host stops the process (exit 1), a stop drains first."""
        watching: list[asyncio.Task[None]] = []

        async def start() -> None:
            await self.control.start()
            await on_start()
            watching.append(asyncio.create_task(self._stop_when_failed(), name="watch-host"))

        async def stop() -> None:
            for task in watching:
                task.cancel()
            await self._drain()
            await on_stop()
            await self.control.stop()

        app = create_app(self.runtime, on_start=start, on_stop=stop)
        return app

    async def _stop_when_failed(self) -> None:
        self.runtime.fail(await self.host.wait_failed())

    async def _drain(self) -> None:
        """The runtime is draining already (no new work is taken): the replies held finish, up to
        drain_timeout_s; a failed host has nothing to wait for."""
        if self.host.failure is not None:
            return
        num_held = len(self.host.claimed_reply_ids())
        if num_held:
            log.info("draining: waiting up to %.0f s for %d replies to finish", self.drain_timeout_s, num_held)
        if not await self.host.wait_idle(self.drain_timeout_s):
            left = self.host.claimed_reply_ids()
            log.warning("drain timed out; giving up %d replies to be continued elsewhere: %s", len(left), ", ".join(left))


def build_worker_parts(role: str, settings: Settings) -> WorkerParts:
    """Checks the internal secret, the model, the device and the gRPC port now, so a bad setting
    fails at start in one line."""
    secret = settings.internal_secret.get_secret_value()
    check_internal_secret(settings.host, secret, is_insecure_allowed=settings.allow_insecure_internal)
    if settings.gil_switch_interval_ms:
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1e3)
    model = open_model(settings.model_path, settings.served_model_name, settings.quantization, settings.model_version)
    spec = EngineSpec.from_settings(settings, model, role)
    grpc_port = settings.grpc_port_for(role)
    check_port_free(settings.host, grpc_port, "TANDEM_GRPC_PORT")
    runtime_config = RuntimeConfig.from_settings(role, settings, uses_redis=False)
    targets = TtftTargets.from_settings(settings, spec.device)
    engine_metrics = EngineMetrics(role, model.name, settings.worker_hour_cost)
    host = EngineHost(spec, runtime_config.instance_id, targets, engine_metrics)
    heartbeats = WorkerHeartbeats(model.name, f"{settings.reachable_host()}:{grpc_port}", host.load, host.claimed_reply_ids)
    runtime = Runtime(runtime_config, heartbeat=heartbeats.build)
    runtime.add_check("engine", host.is_ready)
    control = ControlServer(WorkerControl(runtime, heartbeats), f"{settings.host}:{grpc_port}", secret, tls=runtime_config.tls)
    return WorkerParts(runtime, host, control, settings.drain_timeout_s, HandoffMetrics(role, model.name))
