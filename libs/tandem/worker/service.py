"""What prefill and decode workers share: the model check, the gRPC control server and the
worker heartbeat (carrying the engine's load once it runs)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI

from tandem.config import Settings
from tandem.engine.engine import EngineStats
from tandem.engine.sequence import Lane
from tandem.kernels.metadata import BLOCK_SIZE
from tandem.models.files import ModelFile, open_model
from tandem.runtime import Runtime, RuntimeConfig, check_port_free, create_app
from tandem.v1.common_pb2 import LaneCounts
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat
from tandem.worker.control import ControlServer, WorkerControl


@dataclass(frozen=True)
class EngineLoad:
    """What a worker's heartbeat says about its engine."""

    stats: EngineStats
    num_total_blocks: int
    max_model_len: int
    mean_step_time_ms: float
    last_kv_event_id: int = 0  # the last KV event published


@dataclass
class Worker:
    runtime: Runtime
    model: ModelFile
    grpc_address: str
    control: ControlServer
    engine_load: Callable[[], EngineLoad | None]

    def heartbeat(self, base: ServiceHeartbeat) -> WorkerHeartbeat:
        heartbeat = WorkerHeartbeat(service=base, model=self.model.name, grpc_address=self.grpc_address, kv_block_size=BLOCK_SIZE)
        load = self.engine_load()
        if load is not None:
            s = load.stats.scheduler
            heartbeat.is_engine_ready = True
            heartbeat.max_model_len = load.max_model_len
            heartbeat.kv_blocks_free = s.num_free_blocks
            heartbeat.kv_blocks_total = load.num_total_blocks
            heartbeat.running.CopyFrom(_lanes(s.num_running))
            heartbeat.waiting.CopyFrom(_lanes(s.num_waiting))
            heartbeat.queued_prefill_tokens = s.num_queued_prefill_tokens
            heartbeat.step_time_ms = load.mean_step_time_ms
            heartbeat.kv_event_id = load.last_kv_event_id
        return heartbeat

    def app(
        self,
        routers: Sequence[APIRouter] = (),
        on_start: Callable[[], Awaitable[None]] | None = None,
        on_stop: Callable[[], Awaitable[None]] | None = None,
    ) -> FastAPI:
        async def start() -> None:
            await self.control.start()
            if on_start is not None:
                await on_start()

        async def stop() -> None:
            if on_stop is not None:
                await on_stop()
            await self.control.stop()

        return create_app(self.runtime, routers=routers, on_start=start, on_stop=stop)


def _lanes(counts: dict[Lane, int]) -> LaneCounts:
    return LaneCounts(paid=counts[Lane.PAID], free=counts[Lane.FREE], background=counts[Lane.BACKGROUND])


def build_worker(role: str, settings: Settings, engine_load: Callable[[], EngineLoad | None] = lambda: None) -> Worker:
    """Checks the model and the gRPC port now, so a bad setting fails at start in one line."""
    model = open_model(settings.model_path)
    grpc_port = settings.grpc_port_for(role)
    check_port_free(settings.host, grpc_port, "TANDEM_GRPC_PORT")
    worker: Worker
    runtime = Runtime(RuntimeConfig.from_settings(role, settings, uses_redis=False), heartbeat=lambda base: worker.heartbeat(base))
    control = ControlServer(
        WorkerControl(runtime, stats=lambda: worker.heartbeat(runtime.service_heartbeat(is_ready=not runtime.is_draining))),
        f"{settings.host}:{grpc_port}",
    )
    worker = Worker(runtime, model, f"{settings.reachable_host()}:{grpc_port}", control, engine_load)
    return worker


def build_worker_app(role: str, settings: Settings) -> FastAPI:
    """A worker without an engine yet (the prefill worker until the KV handoff lands)."""
    return build_worker(role, settings).app()
