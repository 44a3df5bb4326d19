"""GET /workers: the live, ready workers by role, as this router sees them (an operator's view;
the router's own choices use the same)."""

from __future__ import annotations

from fastapi import APIRouter

from services.router.placement import Placement
from services.router.prefix_index import PrefixIndex
from services.router.workers import WORKER_ROLES, WorkerRegistry


def workers_router(workers: WorkerRegistry, placement: Placement, index: PrefixIndex) -> APIRouter:
    router = APIRouter(tags=["router"])

    @router.get("/workers")
    async def live_workers() -> dict[str, list[dict[str, object]]]:
        """`engine_ready`: the model is loaded and the worker takes replies; `kv_event_id`: the last
        of its KV events applied to this router's prefix index."""
        return {
            role: [
                {
                    "instance_id": w.instance_id,
                    "model": w.model,
                    "grpc": w.heartbeat.grpc_address,
                    "http_url": w.heartbeat.service.http_url,  # its /metrics, for tandem top
                    "engine_ready": w.heartbeat.is_engine_ready,
                    "max_model_len": w.heartbeat.max_model_len,
                    "load": round(placement.load(w), 3),
                    "kv_event_id": index.last_event_id(w.instance_id),
                }
                for w in workers.workers(role)
                if w.heartbeat.service.is_ready
            ]
            for role in WORKER_ROLES
        }

    return router
