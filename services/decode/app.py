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
from tandem.kvtransfer.interfaces import restrict_ucx_to_host
from tandem.kvtransfer.progress import set_progress_timeout
from tandem.v1.dispatch_pb2 import AssignmentReply
from tandem.worker.assignments import counted, refusal, screen_assignment, too_busy, unrunnable
from tandem.worker.parts import build_worker_parts

ROLE = "decode"
log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, settings: Settings) -> None:
        parts = build_worker_parts(ROLE, settings)
        restrict_ucx_to_host(settings.host)  # before ucxx starts: its TCP sockets on our address only
        set_progress_timeout(settings.ucx_progress_timeout_ms)  # likewise: its progress threads
        self._parts = parts
        self._runtime = parts.runtime
        self._host = parts.host
        self._handoff = KvHandoffService(
            self._host,
            self._runtime,
            settings.reachable_host(),
            settings.ucx_port,
            settings.kv_lease_s,
            handoff_metrics=parts.handoff_metrics,
            listen_host=settings.host,
        )
        parts.control.add_service(self._handoff.add_to_server)

    def app(self) -> FastAPI:
        self._runtime.bus.on_connect(self._subscribe)
        return self._parts.app(on_start=self._start, on_stop=self._stop)

    async def _start(self) -> None:
        await self._handoff.receiver.start()
        await self._host.start(self._runtime.bus)

    async def _stop(self) -> None:
        await self._host.stop()
        await self._handoff.receiver.stop()

    async def _subscribe(self, client: Client) -> None:
        await client.subscribe(subjects.assign(self._runtime.config.instance_id), cb=self._on_assign)
        await self._host.subscribe_cancels(client)

    async def _on_assign(self, msg: Msg) -> None:
        await msg.respond(encode(counted(await self._accept(msg.data))))

    async def _accept(self, data: bytes) -> AssignmentReply:
        screened = await screen_assignment(
            data, self._host, is_draining=self._runtime.is_draining, subject=subjects.assign(self._runtime.config.instance_id)
        )
        if isinstance(screened, AssignmentReply):
            return screened
        assignment, request = screened
        running_epoch = self._host.streaming_epoch(assignment.reply_id)
        if running_epoch is not None:
            if running_epoch >= assignment.epoch:
                return AssignmentReply(accepted=True)  # a retried assignment: it is already running here
            # Continued elsewhere meanwhile (this worker seemed stalled): the old run's events are
            # dropped by the log now, so stop it; the router places the new owner on another try.
            self._host.abort(assignment.reply_id)
            return refusal("superseded", f"an older run of {assignment.reply_id} is still stopping here", retry_after_s=0.5)
        refused = await unrunnable(self._host, request) or too_busy(self._host, request, assignment.epoch)
        if refused is not None:
            return refused  # nothing kept: the router tries another worker
        # Queued without waiting for the engine's step in progress (seconds for a long chunk on a CPU).
        self._host.add(request, assignment.first_seq or 1, assignment.epoch)
        return AssignmentReply(accepted=True)


def build_app(settings: Settings) -> FastAPI:
    return DecodeWorker(settings).app()
