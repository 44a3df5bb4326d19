"""A worker's engine as a service part: loaded on its own thread at start, its outputs published
as TokenEvents (contiguous sequence numbers per reply), its prefix cache's changes as KV events
(and its full state on request), cancels applied, its load reported. Decode and prefill workers
both compose one."""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from nats.aio.client import Client
from nats.aio.msg import Msg

from tandem.bus import BadMessage, decode, encode, subjects
from tandem.bus.cancels import RecentCancels
from tandem.config import Settings
from tandem.engine.engine import Engine, EngineConfig, Request, RequestOutput
from tandem.kernels import select_attention
from tandem.models.loader import default_dtype, load_model
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import Refusal
from tandem.worker.kv_events import KvEventPublisher
from tandem.worker.service import EngineLoad, Worker
from tandem.worker.thread import EngineThread
from tandem.worker.wire import engine_request, token_event

log = logging.getLogger(__name__)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def refusal(reason: str, message: str, retry_after_s: float = 0.0) -> AssignmentReply:
    return AssignmentReply(refused=Refusal(reason=reason, message=message, retry_after_s=retry_after_s))


def is_expired(assignment: Assignment) -> bool:
    """The router stopped waiting for this worker's answer (and may have offered the reply to
    another worker): accepting now would run the reply twice."""
    return 0 < assignment.accept_by_unix_ms < time.time() * 1000


def expired(assignment: Assignment) -> AssignmentReply:
    return refusal("expired", f"{assignment.reply_id} reached this worker after the router's accept-by deadline")


class EngineHost:
    def __init__(self, settings: Settings, worker: Worker) -> None:
        self._settings = settings
        self._worker = worker
        self.thread: EngineThread | None = None
        self._next_seq: dict[str, int] = {}
        self.cancels = RecentCancels()  # a cancel may overtake the reply's assignment
        self._handoffs: dict[str, asyncio.Future[RequestOutput]] = {}
        self._outbox: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self._kv_events: KvEventPublisher | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._kv_events = KvEventPublisher(self._worker.runtime.config.instance_id, loop)
        self.thread = EngineThread(self._build_engine, self._outbox.put_nowait, loop, after_change=self._kv_events.collect)
        self.thread.start()
        self._tasks = [
            asyncio.create_task(self._publish_outputs(), name="publish-tokens"),
            asyncio.create_task(self._publish_kv_events(), name="publish-kv-events"),
        ]

    async def stop(self) -> None:
        if self.thread is not None:
            await asyncio.to_thread(self.thread.stop)
        for task in self._tasks:
            task.cancel()

    def _build_engine(self) -> Engine:
        dtype = default_dtype("cpu") if self._settings.dtype == "auto" else DTYPES[self._settings.dtype]
        loaded = load_model(self._worker.model.path, dtype, "cpu", select_attention("cpu"))
        log.info("engine ready: %s, %s", self._worker.model.name, dtype)
        return Engine(loaded, EngineConfig(kv_cache_mib=self._settings.kv_cache_mib))

    @property
    def engine(self) -> Engine:
        """The engine itself: read-only use from the loop thread (its shape, block views of blocks
        this worker owns); everything else goes through `thread.call`."""
        assert self.thread is not None and self.thread.engine is not None
        return self.thread.engine

    async def is_ready(self) -> bool:
        return self.thread is not None and self.thread.is_ready

    def load(self) -> EngineLoad | None:
        if self.thread is None or not self.thread.is_ready or self.thread.latest_stats is None:
            return None
        stats = self.thread.latest_stats
        mean_step_ms = 1000 * (stats.prefill_time_s + stats.decode_time_s) / max(1, stats.num_steps)
        return EngineLoad(
            stats,
            self.engine.kv_shape.num_blocks,
            self.engine.loaded.config.max_position_embeddings,
            mean_step_ms,
            last_kv_event_id=self._kv_events.last_published_event_id if self._kv_events else 0,
        )

    # -- replies --------------------------------------------------------------------------------

    async def screen_assignment(self, data: bytes) -> tuple[Assignment, Request] | AssignmentReply:
        """The checks every worker makes of an Assignment before taking it: the refusal, or the
        assignment and the engine's request for it."""
        try:
            assignment = decode(data, Assignment)
            subjects.tokens(assignment.reply_id)  # a reply id must be a valid subject token
            request = engine_request(assignment.reply_id, assignment.request)
        except (BadMessage, ValueError) as exc:
            return refusal("bad_request", str(exc))
        if self._worker.runtime.is_draining:
            return refusal("draining", "this worker is draining", retry_after_s=1.0)
        if not await self.is_ready():
            return refusal("loading", "this worker's engine is still loading its model", retry_after_s=2.0)
        if assignment.reply_id in self.cancels:
            return refusal("cancelled", f"{assignment.reply_id} was cancelled before it started")
        if is_expired(assignment):
            return expired(assignment)
        return assignment, request

    def track(self, reply_id: str, first_seq: int) -> None:
        """Publish this reply's tokens from sequence number `first_seq` on."""
        self._next_seq[reply_id] = first_seq

    def untrack(self, reply_id: str) -> None:
        self._next_seq.pop(reply_id, None)

    def is_tracked(self, reply_id: str) -> bool:
        return reply_id in self._next_seq

    def expect_handoff(self, reply_id: str) -> asyncio.Future[RequestOutput]:
        """Resolves with the output that carries a prefill-only request's handoff (its first
        token is published as usual; the reply's stream continues elsewhere)."""
        future = asyncio.get_running_loop().create_future()
        self._handoffs[reply_id] = future
        return future

    async def subscribe_cancels(self, client: Client) -> None:
        await client.subscribe(subjects.CANCEL_ALL, cb=self._on_cancel)

    async def _on_cancel(self, msg: Msg) -> None:
        reply_id = subjects.reply_id_of(msg.subject)
        self.cancels.note(reply_id)
        if reply_id in self._next_seq and self.thread is not None:
            self.thread.post(lambda engine: engine.abort(reply_id))

    async def _publish_kv_events(self) -> None:
        assert self._kv_events is not None and self.thread is not None
        client = await self._worker.runtime.bus.wait_connected()
        await self._kv_events.run(client, self.thread)

    async def _publish_outputs(self) -> None:
        client = await self._worker.runtime.bus.wait_connected()
        worker_id = self._worker.runtime.config.instance_id
        while True:
            for output in await self._outbox.get():
                ends_here = output.is_finished or output.handoff is not None
                handoff = self._handoffs.pop(output.request_id, None) if ends_here else None
                seq = self._next_seq.get(output.request_id)
                if seq is not None:
                    await client.publish(subjects.tokens(output.request_id), encode(token_event(output, seq, worker_id)))
                    self._next_seq[output.request_id] = seq + 1
                    if ends_here:
                        del self._next_seq[output.request_id]
                if handoff is not None and not handoff.done():
                    handoff.set_result(output)
