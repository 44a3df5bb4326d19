"""The prefill worker: runs a request prefill-only (chunked, with its own prefix cache), publishes
the first token at once, and hands the sequence to the decode worker the router chose:

    Reserve on the decode worker (gRPC, it allocates first) -> prefill -> first token out ->
    KV blocks over UCXX into the reserved blocks -> Commit (gRPC) -> free the local blocks.

An assignment is answered at once; the reserve runs in the handoff. Any failure (the decode worker
full or gone, a timeout, the transfer broken) releases the reservation on both sides and returns
the reply to the router: a failed HandoffOutcome on tandem.v1.handoff.<reply_id> naming the tokens
already published, so the router's retry continues the numbering. Every handoff this worker
accepts ends with exactly one HandoffOutcome, and this worker's heartbeat claims the reply until
then (its first token is stamped with the assignment's owner epoch, which the commit carries on)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from fastapi import FastAPI
from nats.aio.client import Client
from nats.aio.msg import Msg

from tandem.bus import encode, subjects, validate
from tandem.bus.events import cancelled_event
from tandem.config import Settings
from tandem.engine.engine import Request, RequestOutput
from tandem.kvtransfer import KvSender, KvTransferError
from tandem.kvtransfer.interfaces import restrict_ucx_to_host
from tandem.kvtransfer.progress import set_progress_timeout
from tandem.v1 import kv_handoff_pb2 as pb
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply, HandoffOutcome
from tandem.v1.kv_handoff_pb2_grpc import KvHandoffStub
from tandem.worker.assignments import counted, refusal, screen_assignment, too_busy, unrunnable
from tandem.worker.host import WorkerFailed
from tandem.worker.internal_grpc import internal_channel
from tandem.worker.parts import build_worker_parts

ROLE = "prefill"
RESERVE_TIMEOUT_S = 2.0
TRANSFER_TIMEOUT_S = 10.0
COMMIT_TIMEOUT_S = 15.0
log = logging.getLogger(__name__)


class HandoffFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Handoff:
    """One reply on its way to a decode worker, and how far it got."""

    assignment: Assignment
    request: Request
    stub: KvHandoffStub
    reservation: pb.Reservation | None = None  # once the decode worker reserved
    output: RequestOutput | None = None  # the first token's output, once the prefill is done

    @property
    def reply_id(self) -> str:
        return self.assignment.reply_id

    @property
    def first_seq(self) -> int:
        return self.assignment.first_seq or 1


class PrefillWorker:
    def __init__(self, settings: Settings) -> None:
        parts = build_worker_parts(ROLE, settings)
        restrict_ucx_to_host(settings.host)  # before ucxx starts: its TCP sockets on our address only
        set_progress_timeout(settings.ucx_progress_timeout_ms)  # likewise: its progress threads
        self._parts = parts
        self._runtime = parts.runtime
        self._host = parts.host
        self._handoff_metrics = parts.handoff_metrics
        self._sender = KvSender(settings.kv_transfer_max_bytes_per_s)
        self._internal_secret = settings.internal_secret.get_secret_value()
        self._stubs: dict[str, tuple[grpc.aio.Channel, KvHandoffStub]] = {}
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self._is_stopping = False

    def app(self) -> FastAPI:
        self._runtime.bus.on_connect(self._subscribe)
        return self._parts.app(on_start=self._start, on_stop=self._stop)

    async def _start(self) -> None:
        await self._host.start(self._runtime.bus)

    async def _stop(self) -> None:
        self._is_stopping = True  # what is in flight goes back to the router, not to the user as cancelled
        for task in self._in_flight.values():
            task.cancel()
        await asyncio.gather(*self._in_flight.values(), return_exceptions=True)
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        await self._host.stop()
        await self._sender.close()
        for channel, _ in self._stubs.values():
            await channel.close()

    async def _subscribe(self, client: Client) -> None:
        await client.subscribe(subjects.assign(self._runtime.config.instance_id), cb=self._on_assign)
        await client.subscribe(subjects.CANCEL_ALL, cb=self._on_cancel)

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            reply_id = validate.cancel(msg.data, msg.subject).reply_id
        except validate.Invalid as exc:  # garbage, or a payload naming another reply than its subject
            validate.drop("cancel", msg.subject, exc)
            return
        self._host.note_cancel(reply_id)
        task = self._in_flight.get(reply_id)
        if task is not None:
            task.cancel()

    async def _on_assign(self, msg: Msg) -> None:
        await msg.respond(encode(counted(await self._accept(msg.data))))

    def _stub(self, address: str) -> KvHandoffStub:
        if address not in self._stubs:
            channel = internal_channel(address, self._internal_secret, self._runtime.config.tls, peer_role="decode")
            self._stubs[address] = (channel, KvHandoffStub(channel))
        return self._stubs[address][1]

    async def _accept(self, data: bytes) -> AssignmentReply:
        """Answers at once (the router waits for the answer): the reserve on the decode worker runs
        in the handoff, whose failure returns the reply to the router as a HandoffOutcome."""
        screened = await screen_assignment(
            data, self._host, is_draining=self._runtime.is_draining, subject=subjects.assign(self._runtime.config.instance_id)
        )
        if isinstance(screened, AssignmentReply):
            return screened
        assignment, request = screened
        if not assignment.decode_grpc_address:
            return refusal("bad_request", "an assignment to a prefill worker must name its decode worker")
        if assignment.reply_id in self._in_flight:
            return AssignmentReply(accepted=True)
        refused = await unrunnable(self._host, request) or too_busy(self._host, request, assignment.epoch)
        if refused is not None:
            return refused  # nothing kept: the router tries another worker
        state = _Handoff(assignment, request, self._stub(assignment.decode_grpc_address))
        self._host.hold(assignment.reply_id)  # claimed until its handoff (or its end) is settled
        task = asyncio.create_task(self._hand_over(state))
        self._in_flight[assignment.reply_id] = task
        task.add_done_callback(lambda done: self._on_done(state, done))
        if self._host.is_cancelled(assignment.reply_id):  # cancelled before it reached us
            task.cancel()
        return AssignmentReply(accepted=True)

    async def _reserve(self, h: _Handoff) -> pb.Reservation:
        """Room on the decode worker for the blocks it lacks (it allocates first), or HandoffFailed."""
        layout = self._host.kv_layout()
        request = h.assignment.request
        num_tokens = len(request.prompt_token_ids) + len(request.generated_token_ids)
        reserve = pb.ReserveRequest(reply_id=h.reply_id, layout=layout, num_blocks=-(-num_tokens // layout.block_size), request=request)
        try:
            reserved = await h.stub.Reserve(reserve, timeout=RESERVE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise HandoffFailed("decode_unreachable", f"reserve: {exc.code().name}") from None
        if reserved.WhichOneof("outcome") != "reservation":
            raise HandoffFailed(reserved.refused.reason, f"reserve refused: {reserved.refused.message}")
        return reserved.reservation

    async def _hand_over(self, h: _Handoff) -> None:
        renewing: asyncio.Task[None] | None = None
        try:
            h.reservation = await self._reserve(h)
            renewing = asyncio.create_task(_renew_lease(h.stub, h.reply_id, h.reservation.lease_s), name=f"renew:{h.reply_id}")
            h.output = await self._host.prefill_only(h.request, h.first_seq, h.assignment.epoch)
            if h.output.handoff is None:  # finished at its first token: nothing to hand over
                await _release(h.stub, h.reply_id)
                await self._publish_outcome(h, HandoffOutcome.RESULT_ENDED)
                return
            await self._send_and_commit(h)
            await self._publish_outcome(h, HandoffOutcome.RESULT_COMMITTED)
        except (HandoffFailed, grpc.aio.AioRpcError) as exc:
            code = exc.code if isinstance(exc, HandoffFailed) else "decode_unreachable"
            log.warning("handoff of %s to %s failed, returning it to the router: %s", h.reply_id, h.assignment.decode_worker_id, exc)
            await _release(h.stub, h.reply_id)
            await self._publish_outcome(h, HandoffOutcome.RESULT_FAILED, code, str(exc))
        except WorkerFailed:  # this worker gave its replies up: the relay continues this one elsewhere
            await _release(h.stub, h.reply_id)
        finally:
            if renewing is not None:
                renewing.cancel()
            if h.output is not None and h.output.handoff is not None:
                self._host.release(h.reply_id)

    async def _send_and_commit(self, h: _Handoff) -> None:
        assert h.reservation is not None and h.output is not None and h.output.handoff is not None
        # The decode worker holds the leading blocks already: send only the rest.
        to_send = h.output.handoff.block_ids[h.reservation.num_cached_blocks :]
        blocks = self._host.block_views(to_send)
        started_s = time.monotonic()
        try:
            where = (h.reservation.ucx_host, h.reservation.ucx_port)
            await self._sender.send(*where, h.reply_id, blocks, TRANSFER_TIMEOUT_S, token=h.reservation.transfer_token)
        except KvTransferError as exc:
            self._handoff_metrics.failed("send", exc.reason)
            raise HandoffFailed("kv_transfer_failed", str(exc)) from None
        self._handoff_metrics.completed("send", sum(b.numel() * b.element_size() for b in blocks), time.monotonic() - started_s)
        continued = Assignment()
        continued.CopyFrom(h.assignment)
        continued.first_seq = h.first_seq + 1
        commit = pb.CommitRequest(
            reply_id=h.reply_id,
            assignment=continued,
            first_token_id=h.output.new_token_ids[0],
            num_cached_tokens=h.output.num_cached_tokens,
        )
        committed = await h.stub.Commit(commit, timeout=COMMIT_TIMEOUT_S)
        if committed.WhichOneof("outcome") == "refused":
            raise HandoffFailed(committed.refused.reason, committed.refused.message)

    def _on_done(self, h: _Handoff, task: asyncio.Task[None]) -> None:
        self._in_flight.pop(h.reply_id, None)
        if task.cancelled():  # also when cancelled before it ever ran: clean up here, not in the task
            cleanup = asyncio.create_task(self._after_cancel(h))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
            cleanup.add_done_callback(lambda _: self._host.let_go(h.reply_id))
        else:
            self._host.let_go(h.reply_id)

    async def _after_cancel(self, h: _Handoff) -> None:
        """tandem.v1.cancel.<reply_id> or shutdown, during the prefill or the handoff."""
        next_seq = self._host.stop_streaming(h.reply_id)  # first: the aborted request's last output is not published
        if h.output is None:
            self._host.discard(h.reply_id)
        await _release(h.stub, h.reply_id)
        if self._is_stopping and not self._host.is_cancelled(h.reply_id):
            # Shutdown, not the user: the router places the reply again (its decode worker is fine).
            await self._publish_outcome(
                h, HandoffOutcome.RESULT_FAILED, "prefill_stopping", "the prefill worker is shutting down", blame_decode=False
            )
            return
        # After the first token when it went out: the stream numbered it even if the prefill's
        # result had not reached this task yet when the cancel came.
        seq = next_seq if next_seq is not None else h.first_seq + (h.output is not None)
        cancelled = cancelled_event(h.reply_id, seq, worker_id=self._runtime.config.instance_id)
        cancelled.epoch = h.assignment.epoch
        await self._host.publish(cancelled)
        await self._publish_outcome(h, HandoffOutcome.RESULT_ENDED, "cancelled")

    async def _publish_outcome(
        self, h: _Handoff, result: HandoffOutcome.Result, reason: str = "", message: str = "", blame_decode: bool = True
    ) -> None:
        """`blame_decode`: name the decode worker, whom the router then avoids for this reply."""
        outcome = HandoffOutcome(
            reply_id=h.reply_id,
            result=result,
            prefill_worker_id=self._runtime.config.instance_id,
            decode_worker_id=h.assignment.decode_worker_id if blame_decode else "",
            reason=reason,
            message=message,
        )
        if result == HandoffOutcome.RESULT_FAILED and h.output is not None:
            outcome.published_token_ids.extend(h.output.new_token_ids)
        try:
            await self._runtime.bus.client.publish(subjects.handoff(h.reply_id), encode(outcome))
        except Exception:
            log.exception("could not publish the handoff outcome of %s", h.reply_id)


async def _renew_lease(stub: KvHandoffStub, reply_id: str, lease_s: float) -> None:
    """Renews the reservation's lease while the handoff works (a long prefill on a busy machine
    can outlast one lease); stops when the decode worker no longer holds it."""
    while True:
        await asyncio.sleep(max(0.1, lease_s / 3))
        try:
            renewed = await stub.Renew(pb.RenewRequest(reply_id=reply_id), timeout=RESERVE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("renewing the reservation of %s failed (%s); trying again", reply_id, exc.code().name)
            continue
        if not renewed.is_reserved:
            log.warning("the decode worker no longer holds the reservation of %s", reply_id)
            return
        lease_s = renewed.lease_s or lease_s


async def _release(stub: KvHandoffStub, reply_id: str) -> None:
    try:
        await stub.Release(pb.ReleaseRequest(reply_id=reply_id), timeout=RESERVE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:  # the decode worker is gone: its lease frees the blocks
        log.warning("release of %s failed (%s); the lease will free its blocks", reply_id, exc.code().name)


def build_app(settings: Settings) -> FastAPI:
    return PrefillWorker(settings).app()
