"""Shadow replies: a request the routers' rollout mirrors to a candidate version
(GenerateReply.shadow_model) is answered a second time, by the candidate, on the background lane.
Its answer is recorded by the relay (tandem.store: shadow answers, next to the stable version's
turn), never streamed, never billed, never counted against a quota: a client never learns its id.

It starts after the shown reply was accepted, in the background, so it delays nothing; a shadow
the router refuses or that cannot start is logged and counted (tandem_chat_shadow_replies_total)
and costs the shown reply nothing."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.chat import metrics
from services.chat.errors import ChatError
from tandem.tokenlog import ReplyMeta, create_reply
from tandem.v1.common_pb2 import LANE_BACKGROUND
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest

log = logging.getLogger(__name__)

# Asks a router for a request (ReplyStarter.ask_router: raises a ChatError when none answered).
AskRouter = Callable[[GenerateRequest], Awaitable[GenerateReply]]
Forget = Callable[[Redis, str], Awaitable[None]]


def shadow_request(primary: GenerateRequest, model: str) -> GenerateRequest:
    """The shown reply's request, for the candidate `model`, as a new reply mirroring it."""
    shadow = GenerateRequest()
    shadow.CopyFrom(primary)
    shadow.reply_id = shadow.request_id = uuid.uuid4().hex
    shadow.model = model
    shadow.shadow_of = primary.reply_id
    shadow.lane = LANE_BACKGROUND
    return shadow


class Shadows:
    """Starts shadow replies and keeps their tasks until they are asked for (no task is lost to
    the garbage collector; a stopping chat cancels those still asking)."""

    def __init__(self, redis: Redis, ask_router: AskRouter, forget: Forget) -> None:
        self._redis = redis
        self._ask_router = ask_router
        self._forget = forget
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, primary: GenerateRequest, model: str) -> None:
        task = asyncio.create_task(self._start(shadow_request(primary, model)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, request: GenerateRequest) -> None:
        meta = ReplyMeta(reply_id=request.reply_id, user_id=request.user_id, model=request.model, request=request.SerializeToString())
        try:
            await create_reply(self._redis, meta, track_readers=False)  # nobody reads it; it runs to its end
            answer = await self._ask_router(request)
        except (ChatError, RedisError) as exc:  # no router answered (the starter forgot the reply), or Redis failed
            log.warning("shadow reply %s of %s on %s did not start: %s", request.reply_id, request.shadow_of, request.model, exc)
            metrics.SHADOW_REPLIES.labels(**metrics.model_labels(request.model), outcome="failed").inc()
            return
        if answer.WhichOneof("outcome") == "refused":
            await self._forget(self._redis, request.reply_id)
            log.info("shadow reply of %s on %s refused: %s", request.shadow_of, request.model, answer.refused.reason)
            metrics.SHADOW_REPLIES.labels(**metrics.model_labels(request.model), outcome="refused").inc()
            return
        log.info("shadow reply %s of %s started on %s", request.reply_id, request.shadow_of, answer.model or request.model)
        metrics.SHADOW_REPLIES.labels(**metrics.model_labels(request.model), outcome="started").inc()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
