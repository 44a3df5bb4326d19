"""The prefill side of a KV handoff: sends a reply's blocks to the decode worker's KvReceiver (see
tandem.kvtransfer.wire for the protocol)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import ucxx

from tandem.kvtransfer import wire
from tandem.kvtransfer.wire import Kind, Reply, Status

if TYPE_CHECKING:
    from ucxx._lib_async import Endpoint


class KvTransferError(RuntimeError):
    """A KV transfer that did not complete. `reason` is one of: the refusals "unknown_reply",
    "bad_token", "count_mismatch", "size_mismatch", "in_flight", "bad_header", "no_destination" (nothing was
    written, the connection stays up); "timeout"; "peer_gone" (the connection failed or could not
    be opened)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class _NoVerdict(Exception):
    """The connection failed before the receiver answered the header."""


class KvSender:
    """The prefill side. One connection per (host, port), opened on first use and reused by later
    and concurrent sends; a send that fails other than by a refusal aborts its connection (so the
    receiver stops writing, and the source blocks may be freed once send() returns) and the next
    send opens a new one. `max_bytes_per_s` (0: none) paces each transfer's blocks so handoffs
    leave room for other traffic on a shared link."""

    def __init__(self, max_bytes_per_s: float = 0.0) -> None:
        self._connections: dict[tuple[str, int], asyncio.Future[_Connection]] = {}
        self._max_bytes_per_s = max_bytes_per_s

    async def send(self, host: str, port: int, reply_id: str, blocks: list[torch.Tensor], timeout_s: float, *, token: bytes) -> None:
        """Sends every block in order into the blocks the receiver reserved for reply_id, with the
        reservation's token; returns once the receiver acknowledged that all bytes landed. Raises
        KvTransferError otherwise, and ValueError for blocks, a reply id or a token that cannot be
        sent (not contiguous, unequal sizes, too long)."""
        header, buffers = _prepare(reply_id, token, blocks)
        where = f"{host}:{port}"
        connection: _Connection | None = None
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                connection = await self._connect(host, port, timeout_s)
                try:
                    await connection.transfer(header, buffers, where, self._max_bytes_per_s)
                except _NoVerdict:
                    if connection.num_transfers == 1:
                        raise
                    # A reused connection the receiver had closed (it aborts a connection whose
                    # transfer it forgets): nothing was written, so one fresh connection may try again.
                    self._drop(host, port, connection)
                    connection = await self._connect(host, port, timeout_s)
                    await connection.transfer(header, buffers, where, self._max_bytes_per_s)
        except asyncio.CancelledError:
            if connection is not None:  # stop sending from blocks the caller may free now
                self._drop(host, port, connection)
            raise
        except KvTransferError as exc:
            if exc.reason not in _REFUSALS and connection is not None:
                self._drop(host, port, connection)
            raise
        except TimeoutError as exc:
            if connection is not None:
                self._drop(host, port, connection)
            if not deadline.expired():  # ucxx's own connect timeout
                raise KvTransferError(f"could not connect to the KV receiver at {where} ({exc!r})", "peer_gone") from exc
            raise KvTransferError(f"the KV transfer of {reply_id} to {where} timed out after {timeout_s} s", "timeout") from None
        except Exception as exc:
            if connection is not None:
                self._drop(host, port, connection)
            cause = wire.describe_error(exc.__cause__ if isinstance(exc, _NoVerdict) and exc.__cause__ else exc)
            message = f"the KV transfer of {reply_id} to {where} failed: receiver gone or unreachable ({cause})"
            raise KvTransferError(message, "peer_gone") from exc

    async def close(self) -> None:
        connections, self._connections = self._connections, {}
        for pending in connections.values():
            if not pending.done():
                pending.cancel()
            elif not pending.cancelled() and pending.exception() is None:
                pending.result().abort()
        await asyncio.gather(*connections.values(), return_exceptions=True)

    async def _connect(self, host: str, port: int, timeout_s: float) -> _Connection:
        key = (host, port)
        pending = self._connections.get(key)
        if pending is None or (pending.done() and _usable(pending) is None):
            pending = asyncio.ensure_future(_Connection.open(host, port, min(timeout_s, _CONNECT_TIMEOUT_S)))
            pending.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved even if nobody waits
            self._connections[key] = pending
        # Shielded: a send that times out while connecting must not cancel a connect that others share.
        return await asyncio.shield(pending)

    def _drop(self, host: str, port: int, connection: _Connection) -> None:
        pending = self._connections.get((host, port))
        if pending is not None and pending.done() and _usable(pending) is connection:
            del self._connections[(host, port)]
        connection.abort()


def _usable(pending: asyncio.Future[_Connection]) -> _Connection | None:
    """The opened connection, if opening it succeeded and it is still up."""
    if pending.cancelled() or pending.exception() is not None or not pending.result().is_alive:
        return None
    return pending.result()


_CONNECT_TIMEOUT_S = 5.0  # ucxx's default
_REFUSALS = {"unknown_reply", "bad_token", "count_mismatch", "size_mismatch", "in_flight", "bad_header", "no_destination"}


class _Connection:
    """One endpoint to a receiver; numbers its transfers so several can run on it at once."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._transfer_ids = itertools.count(1)
        self.num_transfers = 0  # started on it so far

    @classmethod
    async def open(cls, host: str, port: int, timeout_s: float) -> _Connection:
        return cls(await ucxx.create_endpoint(host, port, connect_timeout=timeout_s))

    @property
    def is_alive(self) -> bool:
        return not self._endpoint.closed

    def abort(self) -> None:
        self._endpoint.abort()

    async def transfer(self, header: wire.Header, buffers: list, where: str, max_bytes_per_s: float = 0.0) -> None:
        endpoint = self._endpoint
        transfer_id = next(self._transfer_ids)
        self.num_transfers += 1
        header = dataclasses.replace(header, transfer_id=transfer_id)
        try:
            await endpoint.send(header.pack(), tag=wire.HEADER_TAG)
            verdict = await _recv_reply(endpoint, wire.tag(Kind.VERDICT, transfer_id))
        except Exception as exc:  # the receiver never said go: no byte of the blocks was sent
            raise _NoVerdict(exc) from exc
        if verdict.status != Status.OK:
            reason = verdict.status.name.lower()
            raise KvTransferError(f"{where} refused the KV of {header.reply_id}: {_explain(verdict, header)}", reason)
        started_s = time.monotonic()
        async with asyncio.TaskGroup() as group:
            ack = group.create_task(_recv_reply(endpoint, wire.tag(Kind.ACK, transfer_id)))
            for i, buffer in enumerate(buffers):
                if max_bytes_per_s > 0:  # block i may start once the ones before it fit the rate
                    await asyncio.sleep(started_s + i * header.bytes_per_block / max_bytes_per_s - time.monotonic())
                group.create_task(endpoint.send(buffer, tag=wire.tag(Kind.BLOCK, transfer_id, i)))
        if ack.result().status != Status.OK:
            status = ack.result().status.name
            raise KvTransferError(f"{where} did not acknowledge the KV of {header.reply_id}: {status}", "peer_gone")


async def _recv_reply(endpoint: Endpoint, tag: int) -> Reply:
    data = np.empty(wire.STATUS_BYTES, np.uint8)
    await endpoint.recv(data, tag=tag)
    return Reply.unpack(data)


def _prepare(reply_id: str, token: bytes, blocks: list[torch.Tensor]) -> tuple[wire.Header, list]:
    if len(reply_id.encode()) > wire.MAX_REPLY_ID_BYTES:
        raise ValueError(f"reply id {reply_id[:40]!r}... is longer than {wire.MAX_REPLY_ID_BYTES} bytes")
    if len(token) > wire.TOKEN_BYTES:
        raise ValueError(f"a transfer token of {len(token)} bytes, at most {wire.TOKEN_BYTES} fit")
    if len(blocks) >= wire.MAX_BLOCKS:
        raise ValueError(f"{len(blocks)} blocks is more than one transfer can carry ({wire.MAX_BLOCKS - 1})")
    sizes = {wire.nbytes(b) for b in blocks}
    if len(sizes) > 1:
        raise ValueError(f"blocks of unequal sizes {sorted(sizes)} bytes")
    buffers = [wire.as_buffer(b) for b in blocks]
    return wire.Header(0, reply_id, len(blocks), sizes.pop() if sizes else 0, token), buffers


def _explain(refusal: Reply, sent: wire.Header) -> str:
    match refusal.status:
        case Status.UNKNOWN_REPLY:
            return "unknown reply (no reservation for it: never made, released, or expired)"
        case Status.BAD_TOKEN:
            return "the transfer token is not the one its reservation was made with"
        case Status.COUNT_MISMATCH:
            return f"block count mismatch: {refusal.num_blocks} blocks reserved, {sent.num_blocks} sent"
        case Status.SIZE_MISMATCH:
            theirs, ours = refusal.bytes_per_block, sent.bytes_per_block
            return f"block size mismatch: its blocks hold {theirs} bytes, ours {ours} (KV layouts differ)"
        case Status.IN_FLIGHT:
            return "another transfer of this reply is still arriving"
        case Status.BAD_HEADER:
            return "it could not read our header (another protocol version?)"
        case _:
            return "it cannot receive into its blocks for this reply (see its log)"
