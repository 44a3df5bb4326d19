"""The decode side of a KV handoff: reserve blocks (with a lease), receive the prefill worker's
KV into them over UCXX, then import the sequence on commit. The decode worker allocates first,
so a transfer never lands without room, and never runs a half-written sequence. Each reservation
has its own random token, returned only to the caller of Reserve: the receiver lets in only a
transfer that carries it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from tandem.engine.block_pool import NoFreeBlocks
from tandem.engine.engine import ImportReservation
from tandem.kvtransfer import Destination, KvReceiver, new_token
from tandem.runtime import Runtime
from tandem.v1 import kv_handoff_pb2 as pb
from tandem.v1 import kv_handoff_pb2_grpc
from tandem.v1.generate_pb2 import Refusal
from tandem.worker.engine_metrics import HandoffMetrics
from tandem.worker.host import EngineHost
from tandem.worker.thread import EngineDead
from tandem.worker.wire import engine_request

log = logging.getLogger(__name__)
TRANSFER_WAIT_S = 10.0


@dataclass
class _Reservation:
    blocks: ImportReservation
    lease: asyncio.TimerHandle
    token: bytes  # the transfer into these blocks must carry it
    transfer_started_s: float = 0.0  # when the receiver let its transfer in (for the metrics)
    num_transfer_bytes: int = 0


class KvHandoffService(kv_handoff_pb2_grpc.KvHandoffServicer):
    def __init__(
        self,
        host: EngineHost,
        runtime: Runtime,
        ucx_host: str,
        ucx_port: int,
        lease_s: float,
        *,
        handoff_metrics: HandoffMetrics,
        listen_host: str = "",
    ) -> None:
        """`ucx_host`: the address prefill workers dial; `listen_host`: the KV listener's (empty: all)."""
        self._host = host
        self._handoff_metrics = handoff_metrics
        self._runtime = runtime
        self._lease_s = lease_s
        self._reservations: dict[str, _Reservation] = {}
        self.receiver = KvReceiver(ucx_host, ucx_port, resolve=self._destination, listen_host=listen_host)
        self._ucx_host = ucx_host

    def add_to_server(self, server: grpc.aio.Server) -> None:
        kv_handoff_pb2_grpc.add_KvHandoffServicer_to_server(self, server)

    def _destination(self, reply_id: str) -> Destination | None:
        reservation = self._reservations.get(reply_id)
        if reservation is None:
            return None
        views = self._host.block_views(reservation.blocks.new_block_ids)  # the cached ones stay as they are
        reservation.transfer_started_s = time.monotonic()
        reservation.num_transfer_bytes = sum(view.numel() * view.element_size() for view in views)
        return Destination(views, reservation.token)

    async def Reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext) -> pb.ReserveReply:
        def refuse(reason: str, message: str, retry_after_s: float = 0.0) -> pb.ReserveReply:
            return pb.ReserveReply(refused=Refusal(reason=reason, message=message, retry_after_s=retry_after_s))

        if self._host.failure is not None:
            return refuse("unavailable", f"this decode worker failed and is restarting: {self._host.failure}", 1.0)
        if self._runtime.is_draining:
            return refuse("draining", "this decode worker is draining", 1.0)
        if not await self._host.is_ready():
            return refuse("loading", "this decode worker's engine is still loading", 2.0)
        ours, theirs = self._host.kv_layout(), pb.KvLayout()
        theirs.CopyFrom(request.layout)
        theirs.tensor_parallel_size = max(1, theirs.tensor_parallel_size)  # 0: a sender that does not say, one rank
        if theirs != ours:
            return refuse("layout_mismatch", f"KV layout differs: sender {_show(request.layout)}, this worker {_show(ours)}")
        if self._free(request.reply_id):  # a retry of this reply (its prefill worker died) supersedes the old one
            log.info("a new reserve for %s replaced its uncommitted reservation", request.reply_id)
        try:
            engine_req = engine_request(request.reply_id, request.request)
            await self._host.check(engine_req)  # token ids in the vocabulary, a prompt that fits
        except ValueError as exc:
            return refuse("bad_request", str(exc))
        try:
            blocks = await self._host.reserve_import(engine_req, request.num_blocks)
        except NoFreeBlocks as exc:
            return refuse("no_room", str(exc), 1.0)
        remaining_s = context.time_remaining()
        if remaining_s is not None and remaining_s <= 0:  # the caller gave up while the engine stepped
            self._host.cancel_import(blocks)
            return refuse("expired", "the reserve outlived its deadline")
        if self._host.is_cancelled(request.reply_id):  # cancelled while we reserved: its Release may have come first
            self._host.cancel_import(blocks)
            return refuse("cancelled", f"{request.reply_id} was cancelled")
        lease = asyncio.get_running_loop().call_later(self._lease_s, self._expire, request.reply_id)
        token = new_token()
        self._reservations[request.reply_id] = _Reservation(blocks, lease, token)
        return pb.ReserveReply(
            reservation=pb.Reservation(
                block_ids=blocks.new_block_ids,
                num_cached_blocks=len(blocks.cached_block_ids),
                ucx_host=self._ucx_host,
                ucx_port=self.receiver.port,
                lease_s=self._lease_s,
                transfer_token=token,
            )
        )

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitReply:
        def refuse(reason: str, message: str) -> pb.CommitReply:
            return pb.CommitReply(refused=Refusal(reason=reason, message=message))

        reservation = self._reservations.get(request.reply_id)
        if self._host.failure is not None:
            return refuse("unavailable", f"this decode worker failed and is restarting: {self._host.failure}")
        if self._host.is_cancelled(request.reply_id):
            self._free(request.reply_id)
            return refuse("cancelled", f"{request.reply_id} was cancelled during its handoff")
        if reservation is None:
            return refuse("no_reservation", f"{request.reply_id} holds no reservation here (released, or its lease expired)")
        if not await self.receiver.wait_received(request.reply_id, TRANSFER_WAIT_S):
            self._free(request.reply_id)
            self._handoff_metrics.failed("receive", "transfer_incomplete")
            return refuse("transfer_incomplete", f"the KV of {request.reply_id} did not arrive within {TRANSFER_WAIT_S:.0f} s")
        try:
            engine_req = engine_request(request.reply_id, request.assignment.request)
        except ValueError as exc:
            self._free(request.reply_id)
            return refuse("bad_request", str(exc))
        reservation.lease.cancel()
        del self._reservations[request.reply_id]
        self.receiver.forget(request.reply_id)
        if reservation.transfer_started_s:  # a transfer came (none when every block was cached here)
            elapsed_s = time.monotonic() - reservation.transfer_started_s
            self._handoff_metrics.completed("receive", reservation.num_transfer_bytes, elapsed_s)
        try:
            await self._host.import_sequence(
                engine_req,
                reservation.blocks,
                request.first_token_id,
                request.num_cached_tokens,
                request.assignment.first_seq,
                request.assignment.epoch,
            )
        except ValueError as exc:
            self._host.cancel_import(reservation.blocks)
            return refuse("bad_request", str(exc))
        except EngineDead as exc:
            return refuse("unavailable", f"this decode worker's engine died: {exc}")
        return pb.CommitReply(accepted=True)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseReply:
        return pb.ReleaseReply(was_reserved=self._free(request.reply_id))

    async def Renew(self, request: pb.RenewRequest, context: grpc.aio.ServicerContext) -> pb.RenewReply:
        """The prefill worker is still at it (a long prefill, a slow link): the lease starts again."""
        reservation = self._reservations.get(request.reply_id)
        if reservation is None:
            return pb.RenewReply(is_reserved=False)
        reservation.lease.cancel()
        reservation.lease = asyncio.get_running_loop().call_later(self._lease_s, self._expire, request.reply_id)
        return pb.RenewReply(is_reserved=True, lease_s=self._lease_s)

    def _expire(self, reply_id: str) -> None:
        if self._free(reply_id):
            self._handoff_metrics.failed("receive", "lease_expired")
            log.warning("the reservation of %s expired uncommitted; its blocks are free again", reply_id)

    def _free(self, reply_id: str) -> bool:
        reservation = self._reservations.pop(reply_id, None)
        if reservation is None:
            return False
        reservation.lease.cancel()
        self.receiver.forget(reply_id)
        self._host.cancel_import(reservation.blocks)
        return True


def _show(layout: pb.KvLayout) -> str:
    return (
        f"{layout.model} {layout.dtype} block {layout.block_size} x {layout.num_layers} layers x "
        f"{layout.num_kv_heads} kv heads x {layout.head_dim} ({layout.byte_order}-endian) on {max(1, layout.tensor_parallel_size)} ranks"
    )
