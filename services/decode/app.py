"""The decode worker: continuous batching on its engine. Replies come two ways: an Assignment
from the router (prefilled here, for short uncached prompts) or a KV handoff from a prefill
worker (Reserve, UCXX transfer, Commit on the KvHandoff gRPC service). Every new token goes out
as a TokenEvent on tandem.v1.tokens.<reply_id>."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.decode.handoff import KvHandoffService
from tandem.bus import encode, subjects
from tandem.config import Settings
from tandem.v1 import kv_handoff_pb2_grpc
from tandem.v1.dispatch_pb2 import AssignmentReply
from tandem.worker.host import EngineHost, refusal
from tandem.worker.service import build_worker

ROLE = "decode"
log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, settings: Settings) -> None:
        self._worker = build_worker(ROLE, settings, lambda: self._host.load())
        self._host = EngineHost(settings, self._worker)
        runtime = self._worker.runtime
        self._handoff = KvHandoffService(
            self._host,
            self._worker.model.name,
            settings.reachable_host(),
            settings.ucx_port,
            settings.kv_lease_s,
            lambda: runtime.is_draining,
        )
        self._worker.control.add_service(lambda server: kv_handoff_pb2_grpc.add_KvHandoffServicer_to_server(self._handoff, server))

    def app(self) -> FastAPI:
        self._worker.runtime.add_check("engine", self._host.is_ready)
        self._worker.runtime.bus.on_connect(self._subscribe)
        return self._worker.app(on_start=self._start, on_stop=self._stop)

    async def _start(self) -> None:
        await self._handoff.receiver.start()
        await self._host.start()

    async def _stop(self) -> None:
        await self._host.stop()
        await self._handoff.receiver.stop()

    async def _subscribe(self, client: Client) -> None:
        await client.subscribe(subjects.assign(self._worker.runtime.config.instance_id), cb=self._on_assign)
        await self._host.subscribe_cancels(client)

    async def _on_assign(self, msg: Msg) -> None:
        await msg.respond(encode(await self._accept(msg.data)))

    async def _accept(self, data: bytes) -> AssignmentReply:
        screened = await self._host.screen_assignment(data)
        if isinstance(screened, AssignmentReply):
            return screened
        assignment, request = screened
        if self._host.is_tracked(assignment.reply_id):
            return AssignmentReply(accepted=True)  # a retried assignment: it is already running here
        try:
            self._host.engine.check(request)
        except ValueError as exc:  # PromptTooLong, EmptyPrompt
            return refusal("prompt_too_long" if "prompt of" in str(exc) else "bad_request", str(exc))
        self._host.track(assignment.reply_id, assignment.first_seq or 1)
        # Queued without waiting for the engine's step in progress (seconds for a long chunk on a CPU).
        self._host.thread.post(lambda engine: engine.add(request))
        return AssignmentReply(accepted=True)


def build_app(settings: Settings) -> FastAPI:
    return DecodeWorker(settings).app()
