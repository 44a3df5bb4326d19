"""Wiring of the router process: the live worker view from heartbeats, the prefix index from KV
events, `tandem.v1.generate` (the model version, admission, placement, dispatch to decode workers), the
overload ladder's observations and the model rollout (its file, reply outcomes, rollbacks)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.router.cached_tokens import IndexedCachedTokens
from services.router.dispatch import DispatchConfig, nats_assign
from services.router.generate import GenerateService
from services.router.ladder import Ladder
from services.router.ladder_watch import LadderWatch
from services.router.lanes import LaneRefusals, WaitTargets
from services.router.overload import Overload, OverloadConfig
from services.router.placement import Placement, PlacementConfig
from services.router.pools import ModelPools
from services.router.prefix_index import PrefixIndex, nats_fetch_state
from services.router.rollout import RolloutConfig, RolloutFile
from services.router.rollout_state import Rollouts
from services.router.rollout_watch import RolloutWatch
from services.router.versions import VersionPicker
from services.router.workers import WORKER_ROLES, WorkerRegistry
from services.router.workers_api import workers_router
from tandem import metrics
from tandem.bus import subjects, validate
from tandem.bus.token_stream import publish_final, wait_for_token_stream
from tandem.config import Settings
from tandem.runtime import Runtime, RuntimeConfig, create_app
from tandem.v1.tokens_pb2 import TokenEvent

ROLE = "router"
QUEUE_GROUP = "router"  # several routers share the generate requests
SHUTDOWN_DISPATCH_WAIT_S = 3.0
# A router that starts takes requests once it has heard a decode worker, or after this many
# heartbeat intervals with none: a router restarted under load (a rolling upgrade) would
# otherwise refuse its first requests with no_workers (the chat resends a generate while no
# router is subscribed, so they wait instead).
FIRST_HEARTBEAT_WAIT_INTERVALS = 2.5
KV_STATE_TIMEOUT_S = 2.0
log = logging.getLogger(__name__)


def build_app(settings: Settings) -> FastAPI:
    runtime = Runtime(RuntimeConfig.from_settings(ROLE, settings, uses_redis=False))
    index = PrefixIndex(nats_fetch_state(runtime.bus, KV_STATE_TIMEOUT_S))
    refusals = LaneRefusals()

    def forget_worker(instance_id: str) -> None:
        index.forget(instance_id)
        refusals.forget(instance_id)

    workers = WorkerRegistry(expiry_s=3.0, on_forget=forget_worker)
    targets = WaitTargets.from_settings(settings)
    ladder = Ladder(settings.ladder_interval_s)
    pools = ModelPools.from_settings(settings)
    overload = Overload(
        ladder,
        OverloadConfig(free_max_tokens=settings.ladder_free_max_tokens, start_deadline_s=settings.ladder_start_deadline_s, targets=targets),
    )
    ladder_task: asyncio.Task[None] | None = None
    rollout_config = RolloutConfig.from_settings(settings)
    rollouts = Rollouts(rollout_config.rule)
    rollout_file = RolloutFile(rollout_config.file)
    if rollout_config.file is None:
        log.info("no rollout file (rollout_file unset): each model name is answered by its most served version")
    rollout_task: asyncio.Task[None] | None = None
    placement = Placement(
        PlacementConfig(remote_prefill_min_tokens=settings.remote_prefill_min_tokens), cached_tokens=IndexedCachedTokens(index)
    )
    dispatch_config = DispatchConfig()
    generate: GenerateService | None = None
    generate_subscription: Subscription | None = None
    is_subscribed = False
    decode_worker_heard = asyncio.Event()

    async def on_heartbeat(msg: Msg) -> None:
        try:
            heartbeat = validate.worker_heartbeat(msg.data, msg.subject)
        except validate.Invalid as exc:
            validate.drop("heartbeat", msg.subject, exc)
            return
        metrics.HEARTBEATS_SEEN.labels(role=heartbeat.service.role).inc()
        workers.observe(heartbeat)
        index.observe_heartbeat(heartbeat)
        if heartbeat.service.role == "decode":
            decode_worker_heard.set()

    async def on_kv_event(msg: Msg) -> None:
        try:
            event = validate.kv_event(msg.data, msg.subject)  # its worker id is the subject's
        except validate.Invalid as exc:
            validate.drop("kv_event", msg.subject, exc)
            return
        index.apply(event)

    async def subscribe(client: Client) -> None:
        nonlocal generate, generate_subscription, is_subscribed, ladder_task, rollout_task
        for role in WORKER_ROLES:
            await client.subscribe(subjects.heartbeats_of(role), cb=on_heartbeat)
        await client.subscribe(subjects.KV_EVENTS_ALL, cb=on_kv_event)
        token_stream = await wait_for_token_stream(client, retry_s=0.5)  # made by `tandem bus init`

        async def publish_event(event: TokenEvent) -> None:
            await publish_final(token_stream, event)

        generate = GenerateService(
            workers,
            placement,
            nats_assign(client, dispatch_config.assign_timeout_s, dispatch_config.accept_margin_s),
            publish_event,
            dispatch_config,
            overload,
            targets,
            refusals,
            pools,
            VersionPicker(rollouts),
        )
        rollout_watch = RolloutWatch(runtime.config.instance_id, rollout_file, rollouts, client.publish, rollout_config.reload_s)
        rollout_watch.reload()  # the first requests are split by the file already
        await client.subscribe(subjects.OUTCOMES, cb=rollout_watch.on_outcome)
        await client.subscribe(subjects.ROLLOUT, cb=rollout_watch.on_status)
        await client.subscribe(subjects.CANCEL_ALL, cb=generate.on_cancel)
        await client.subscribe(subjects.HANDOFFS_ALL, cb=generate.outcomes.on_message)
        wait_s = FIRST_HEARTBEAT_WAIT_INTERVALS * settings.heartbeat_interval_s
        try:
            await asyncio.wait_for(decode_worker_heard.wait(), timeout=wait_s)
        except TimeoutError:
            log.info("no decode worker heard within %.1f s; taking requests (refused no_workers until one is)", wait_s)
        generate_subscription = await client.subscribe(subjects.GENERATE, queue=QUEUE_GROUP, cb=generate.on_request)
        await client.flush()  # the server has the subscriptions before we call ourselves ready
        watch = LadderWatch(runtime.config.instance_id, ladder, workers, targets.free_s, client.publish, pools)
        ladder_task = asyncio.create_task(watch.run(), name="overload-ladder")
        rollout_task = asyncio.create_task(rollout_watch.run(), name="model-rollout")
        is_subscribed = True

    async def has_subscribed() -> bool:
        return is_subscribed

    async def on_stop() -> None:
        for task in (ladder_task, rollout_task):
            if task is not None:
                task.cancel()
        # No new requests reach this router; those already taken are answered and dispatched.
        if generate_subscription is not None and runtime.bus.is_connected:
            await generate_subscription.drain()
        if generate is not None:
            await generate.wait_idle(SHUTDOWN_DISPATCH_WAIT_S)
        await index.wait_resynced()

    runtime.bus.on_connect(subscribe)
    runtime.add_check("subscribed", has_subscribed)

    return create_app(runtime, routers=[workers_router(workers, placement, index)], on_stop=on_stop)
