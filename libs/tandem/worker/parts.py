"""What every worker is made of, built in dependency order: the engine host first, then the
heartbeat that reports its load, the runtime that sends that heartbeat, and the gRPC control
server that answers Stats with it. Prefill and decode workers add their own parts around these."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import FastAPI

from tandem.config import Settings
from tandem.models.files import open_model
from tandem.runtime import Runtime, RuntimeConfig, check_port_free, create_app
from tandem.worker.control import ControlServer, WorkerControl
from tandem.worker.heartbeat import WorkerHeartbeats
from tandem.worker.host import EngineHost, EngineSpec


@dataclass(frozen=True)
class WorkerParts:
    runtime: Runtime
    host: EngineHost
    control: ControlServer

    def app(self, on_start: Callable[[], Awaitable[None]], on_stop: Callable[[], Awaitable[None]]) -> FastAPI:
        """The worker's app: the control server runs around the worker's own start and stop."""

        async def start() -> None:
            await self.control.start()
            await on_start()

        async def stop() -> None:
            await on_stop()
            await self.control.stop()

        return create_app(self.runtime, on_start=start, on_stop=stop)


def build_worker_parts(role: str, settings: Settings) -> WorkerParts:
    """Checks the model, the device and the gRPC port now, so a bad setting fails at start in one line."""
    model = open_model(settings.model_path)
    spec = EngineSpec.from_settings(settings, model)
    grpc_port = settings.grpc_port_for(role)
    check_port_free(settings.host, grpc_port, "TANDEM_GRPC_PORT")
    runtime_config = RuntimeConfig.from_settings(role, settings, uses_redis=False)
    host = EngineHost(spec, runtime_config.instance_id)
    heartbeats = WorkerHeartbeats(model.name, f"{settings.reachable_host()}:{grpc_port}", host.load)
    runtime = Runtime(runtime_config, heartbeat=heartbeats.build)
    runtime.add_check("engine", host.is_ready)
    control = ControlServer(WorkerControl(runtime, heartbeats), f"{settings.host}:{grpc_port}")
    return WorkerParts(runtime, host, control)
