"""The decode side of a KV handoff: a UCXX listener that receives a reply's blocks straight into
the block memory reserved for it (see tandem.kvtransfer.wire for the protocol). Only a transfer
carrying the reservation's token is let in; every refusal is logged and counted."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import ucxx
from prometheus_client import Counter

from tandem.kvtransfer import wire
from tandem.kvtransfer.interfaces import bind_listener_to_host
from tandem.kvtransfer.wire import Kind, Reply, Status

if TYPE_CHECKING:
    from ucxx._lib_async import Endpoint, Listener

log = logging.getLogger(__name__)

_DRAIN_TURNS = 1000
# An idle connection's next header is probed for at these intervals, doubling from the first to
# the last: a transfer that follows another at once starts within a millisecond, one after a pause
# within _PROBE_MAX_S, and an idle connection wakes the loop ~125 times a second.
_PROBE_FIRST_S = 0.0005
_PROBE_MAX_S = 0.008
TRANSFERS_REFUSED = Counter("tandem_kv_transfers_refused_total", "KV transfers this decode worker refused, by reason", ["reason"])


@dataclass(frozen=True)
class Destination:
    """Where a reservation's KV lands, and the token a transfer into it must carry."""

    views: list[torch.Tensor]
    token: bytes


Resolve = Callable[[str], Destination | None]


@dataclass(frozen=True, eq=False)
class _Inbound:
    """A transfer being received: forgetting its reply aborts the connection it arrives on."""

    endpoint: Endpoint


async def _header_arrived(endpoint: Endpoint) -> bool:
    """Waits until the connection's next header is here (True) or the connection is gone (False).

    Probed, not received: a receive left posted is awaited by ucxx polling it on every loop turn
    (its default, without Python futures), so an idle connection kept the decode worker's event loop
    at a full core, taken from its engine, from its first handoff on. (ucxx's Python futures avoid
    the polling, but crashed the tests' repeated resets in ucxx 0.52.)"""
    delay_s = _PROBE_FIRST_S
    while not endpoint.tag_probe(wire.HEADER_TAG).matched:
        if endpoint.closed:
            return False
        await asyncio.sleep(delay_s)
        delay_s = min(2 * delay_s, _PROBE_MAX_S)
    return True


class KvReceiver:
    """The decode side: a UCXX listener that receives a reply's blocks straight into reserved block
    memory.

    `resolve(reply_id)` gives the reservation's Destination: its block views in order (contiguous
    CPU or CUDA tensors) and its token; or None for a reply this worker holds no reservation for.
    A transfer for no reservation, or with another token, is refused and nothing is written. It
    runs on the event loop, once per transfer, so it must be quick.

    Blocks are freed only after `forget(reply_id)`: it aborts a transfer of that reply that is still
    arriving (closing the connection it arrives on), so no late byte lands in reused memory.

    `host` is the address advertised to senders; `listen_host` the one to listen on (empty: every
    interface). The Python ucxx cannot bind its listener to an address, so the listener is bound
    to the interface that holds it (tandem.kvtransfer.interfaces); the token keeps the peers
    that can reach it out of other replies' blocks.
    """

    def __init__(self, host: str, port: int = 0, *, resolve: Resolve, listen_host: str = "") -> None:
        self._host = host
        self._listen_host = listen_host
        self._port = port
        self._resolve = resolve
        self._listener: Listener | None = None
        self._is_stopped = False
        self._connections: set[Endpoint] = set()
        self._serving: set[asyncio.Task] = set()
        self._in_flight: dict[str, _Inbound] = {}
        self._received: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        if self._listener is not None or self._is_stopped:
            raise RuntimeError("a KvReceiver starts once")
        self._listener = ucxx.create_listener(self._serve, port=self._port)
        self._port = self._listener.port
        interface = bind_listener_to_host(self._port, self._listen_host)
        log.info("KV listener on port %d, interface %s", self._port, interface or "all")

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The listening port (after start(); the requested one before)."""
        return self._port

    async def wait_received(self, reply_id: str, timeout_s: float) -> bool:
        """True once every block of the reply has landed (its sender's send() returns only after
        this is true); False if that does not happen within timeout_s."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._event(reply_id).wait()
        except TimeoutError:
            return False
        return True

    def forget(self, reply_id: str) -> None:
        """Drops the reply's completion state, and aborts a transfer of it that is still arriving.
        Call it (after commit or release) before the reply's blocks are reused."""
        self._received.pop(reply_id, None)
        inbound = self._in_flight.pop(reply_id, None)
        if inbound is not None:
            log.warning("KV of %s still arriving when it was forgotten: aborting its connection", reply_id)
            inbound.endpoint.abort()

    async def stop(self) -> None:
        """Stops listening, aborts every connection (and so every transfer still arriving), and
        returns once their handlers are done."""
        self._is_stopped = True  # a connection accepted from now on is closed at once
        for endpoint in list(self._connections):
            endpoint.abort()
        await asyncio.gather(*self._serving, return_exceptions=True)
        self._in_flight.clear()
        if self._listener is not None:
            # ucxx counts a handler as active until a loop turn after it returned, and warns when a
            # listener is closed under an active one.
            for _ in range(_DRAIN_TURNS):
                if self._listener.active_clients == 0:
                    break
                await asyncio.sleep(0.001)
            self._listener.close()
            self._listener = None

    def _event(self, reply_id: str) -> asyncio.Event:
        return self._received.setdefault(reply_id, asyncio.Event())

    async def _serve(self, endpoint: Endpoint) -> None:
        """One sender's connection: reads headers and starts a transfer for each, until it closes."""
        if self._is_stopped:
            endpoint.abort()
            return
        serving = asyncio.current_task()
        assert serving is not None  # a coroutine run by the listener's task
        self._serving.add(serving)
        self._connections.add(endpoint)
        transfers: set[asyncio.Task] = set()
        try:
            while True:
                header = np.empty(wire.HEADER_BYTES, np.uint8)
                try:
                    if not await _header_arrived(endpoint):
                        log.debug("KV connection closed")
                        return
                    await endpoint.recv(header, tag=wire.HEADER_TAG)
                except Exception as exc:  # closed by the peer or by us, or a message of the wrong size
                    log.debug("KV connection closed: %s: %s", type(exc).__name__, exc)
                    return
                transfer = asyncio.create_task(self._receive(endpoint, header))
                transfers.add(transfer)
                transfer.add_done_callback(transfers.discard)
        finally:
            self._connections.discard(endpoint)
            endpoint.abort()
            await asyncio.gather(*transfers, return_exceptions=True)
            self._serving.discard(serving)

    async def _receive(self, endpoint: Endpoint, data: np.ndarray) -> None:
        try:
            header = wire.Header.unpack(data)
        except wire.BadHeader as exc:
            TRANSFERS_REFUSED.labels("bad_header").inc()
            log.warning("refused a KV transfer with a bad header: %s", exc)
            await _answer(endpoint, wire.tag(Kind.VERDICT, exc.transfer_id), Reply(Status.BAD_HEADER))
            return
        verdict, buffers = self._admit(endpoint, header)
        if verdict.status != Status.OK:
            reason = verdict.status.name.lower()
            TRANSFERS_REFUSED.labels(reason).inc()
            log.warning("refused the KV of %s: %s", header.reply_id, reason)
            await _answer(endpoint, wire.tag(Kind.VERDICT, header.transfer_id), verdict)
            return
        inbound = self._in_flight[header.reply_id]
        is_landed = await _land(endpoint, header, verdict, buffers)
        if self._in_flight.get(header.reply_id) is not inbound:
            return  # forgotten while arriving: its connection was aborted, its blocks are not ours now
        del self._in_flight[header.reply_id]
        if is_landed:
            self._event(header.reply_id).set()
            ack = Reply(Status.OK, header.num_blocks, header.bytes_per_block)
            await _answer(endpoint, wire.tag(Kind.ACK, header.transfer_id), ack)

    def _admit(self, endpoint: Endpoint, header: wire.Header) -> tuple[Reply, list]:
        """Checks a header against the reply's reservation (its token first, so another peer learns
        nothing about it); on OK, the transfer is in flight."""
        try:
            destination = self._resolve(header.reply_id)
        except Exception:
            log.exception("resolve(%r) failed", header.reply_id)
            return Reply(Status.NO_DESTINATION), []
        if destination is None:
            return Reply(Status.UNKNOWN_REPLY), []
        if not hmac.compare_digest(header.token, destination.token):
            return Reply(Status.BAD_TOKEN), []
        if header.reply_id in self._in_flight:
            return Reply(Status.IN_FLIGHT), []
        views = destination.views
        sizes = [wire.nbytes(v) for v in views]
        held = Reply(Status.OK, len(views), sizes[0] if sizes else 0)
        if len(views) != header.num_blocks:
            return Reply(Status.COUNT_MISMATCH, held.num_blocks, held.bytes_per_block), []
        if any(size != header.bytes_per_block for size in sizes):
            return Reply(Status.SIZE_MISMATCH, held.num_blocks, held.bytes_per_block), []
        try:
            buffers = [wire.as_buffer(v) for v in views]
        except ValueError as exc:
            log.error("cannot receive the KV of %s: %s", header.reply_id, exc)
            return Reply(Status.NO_DESTINATION), []
        self._in_flight[header.reply_id] = _Inbound(endpoint)
        self._event(header.reply_id).clear()  # a resend overwrites the blocks: not landed until it is done
        return held, buffers


async def _land(endpoint: Endpoint, header: wire.Header, verdict: Reply, buffers: list) -> bool:
    """Says go, and receives every block straight into its destination; False if that failed."""
    try:
        await endpoint.send(verdict.pack(), tag=wire.tag(Kind.VERDICT, header.transfer_id))
        async with asyncio.TaskGroup() as group:
            for i, buffer in enumerate(buffers):
                group.create_task(endpoint.recv(buffer, tag=wire.tag(Kind.BLOCK, header.transfer_id, i)))
    except Exception as exc:
        # The sender vanished or aborted, or forget() aborted the connection: no more bytes land.
        log.warning("the KV of %s did not arrive: %s", header.reply_id, wire.describe_error(exc))
        endpoint.abort()
        return False
    return True


async def _answer(endpoint: Endpoint, tag: int, reply: Reply) -> None:
    try:
        await endpoint.send(reply.pack(), tag=tag)
    except Exception as exc:
        log.debug("could not answer a KV sender (%s: %s)", type(exc).__name__, exc)
