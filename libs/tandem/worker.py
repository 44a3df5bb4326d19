"""What prefill and decode workers share: the model check, the gRPC control server and the
worker heartbeat. The engine plugs in here with the engine and disaggregation work."""

from __future__ import annotations

from fastapi import FastAPI

from tandem.config import Settings
from tandem.control import ControlServer, WorkerControl
from tandem.models.files import open_model
from tandem.service import Runtime, RuntimeConfig, check_port_free, create_app
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat

KV_BLOCK_SIZE = 16


def build_worker_app(role: str, settings: Settings) -> FastAPI:
    model = open_model(settings.model_path)
    grpc_port = settings.grpc_port_for(role)
    check_port_free(settings.host, grpc_port, "TANDEM_GRPC_PORT")
    grpc_address = f"{settings.reachable_host()}:{grpc_port}"

    def heartbeat(base: ServiceHeartbeat) -> WorkerHeartbeat:
        return WorkerHeartbeat(service=base, model=model.name, grpc_address=grpc_address, kv_block_size=KV_BLOCK_SIZE)

    runtime = Runtime(RuntimeConfig.from_settings(role, settings, uses_redis=False), heartbeat=heartbeat)
    control = ControlServer(
        WorkerControl(runtime, stats=lambda: heartbeat(runtime.service_heartbeat(is_ready=not runtime.is_draining))),
        f"{settings.host}:{grpc_port}",
    )
    return create_app(runtime, on_start=control.start, on_stop=control.stop)
