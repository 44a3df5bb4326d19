"""Wiring of the router process: the live worker view now; admission and dispatch join with the
disaggregation issue."""

from __future__ import annotations

import logging

from fastapi import APIRouter, FastAPI
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.router.workers import WorkerRegistry
from tandem import metrics
from tandem.bus import BadMessage, decode, subjects
from tandem.config import Settings
from tandem.service import Runtime, RuntimeConfig, create_app
from tandem.v1.worker_pb2 import WorkerHeartbeat

ROLE = "router"
WORKER_ROLES = ("prefill", "decode")
log = logging.getLogger(__name__)


def build_app(settings: Settings) -> FastAPI:
    runtime = Runtime(RuntimeConfig.from_settings(ROLE, settings, uses_redis=False))
    workers = WorkerRegistry(expiry_s=3.0)

    async def on_heartbeat(msg: Msg) -> None:
        try:
            heartbeat = decode(msg.data, WorkerHeartbeat)
        except BadMessage as exc:
            log.warning("dropped a heartbeat on %s: %s", msg.subject, exc)
            return
        metrics.HEARTBEATS_SEEN.labels(role=heartbeat.service.role).inc()
        workers.observe(heartbeat)

    is_subscribed = False

    async def subscribe(client: Client) -> None:
        nonlocal is_subscribed
        for role in WORKER_ROLES:
            await client.subscribe(subjects.heartbeats_of(role), cb=on_heartbeat)
        await client.flush()  # the server has the subscriptions before we call ourselves ready
        is_subscribed = True

    async def has_subscribed() -> bool:
        return is_subscribed

    runtime.bus.on_connect(subscribe)
    runtime.add_check("subscribed", has_subscribed)

    api = APIRouter(tags=["router"])

    @api.get("/workers")
    async def live_workers() -> dict[str, list[dict[str, str]]]:
        """Live, ready workers by role (an operator's view; the router's own choices use the same)."""
        return {
            role: [{"instance_id": w.service.instance_id, "model": w.model, "grpc": w.grpc_address} for w in workers.live(role)]
            for role in WORKER_ROLES
        }

    return create_app(runtime, routers=[api])
