"""A live reply's new events written by its feed straight to the connections of the streams that
wait for them, without waking each stream's task.

A chat instance holding thousands of streams spends its time per event and stream: a task
woken (`Event.set`, then the resumption of the response's generators and sends) and a write.
Profiled with 3,000 streams, the wake and the generators took more of the event loop than the
writes. The feed's new events are the same bytes for every subscriber that waits at the log's
end, so the feed frames them once and writes them to each such connection's transport itself.

This knows uvicorn's httptools protocol (the server `tandem up`, the images and `make run`
start): its response cycle's transport, flow control and chunked framing. That is a server's
internals, and it is held here alone: `DirectWriter.of` answers None for any other server (h11,
hypercorn), whose streams then take the ASGI path, as do a stream's first bytes, its end, an
error event (per request), anything written while the client is slow (the transport paused), and
the stream of the request that started the reply (its latency is measured at its writes)."""

from __future__ import annotations

from typing import Any

from starlette.types import Send


class DirectWriter:
    """One HTTP/1.1 response's connection, for body chunks written while its ASGI task waits."""

    __slots__ = ("_cycle", "_transport", "num_writes")

    def __init__(self, cycle: Any, transport: Any) -> None:
        self._cycle = cycle
        self._transport = transport
        self.num_writes = 0  # chunks written this way so far

    @property
    def is_paused(self) -> bool:
        """The client reads slower than the stream: the server holds writes until it catches up."""
        return bool(self._cycle.flow.write_paused)

    @classmethod
    def of(cls, server_send: Send | None) -> DirectWriter | None:
        """The writer of the response `server_send` (the server's own send, under every
        middleware) belongs to; None unless it is uvicorn's httptools response cycle."""
        cycle = getattr(server_send, "__self__", None)
        transport = getattr(cycle, "transport", None)
        flow = getattr(cycle, "flow", None)
        if cycle is None or not hasattr(cycle, "chunked_encoding") or not hasattr(flow, "write_paused"):
            return None
        if not (callable(getattr(transport, "write", None)) and callable(getattr(transport, "is_closing", None))):
            return None
        if not hasattr(cycle, "disconnected") or not hasattr(cycle, "response_complete"):
            return None
        return cls(cycle, transport)

    @staticmethod
    def frame(body: bytes) -> bytes:
        """`body` as one chunk of a chunked response (what the server's send writes for it)."""
        return b"%x\r\n%b\r\n" % (len(body), body)

    def write(self, chunk: bytes) -> bool:
        """Writes a `frame`d chunk now; False, writing nothing, when the response cannot take it
        this way: its headers not sent as chunked yet, it ended, the client left, or the client
        reads slower than the stream (the transport paused: the ASGI send waits for it)."""
        cycle = self._cycle
        if cycle.chunked_encoding is not True or cycle.response_complete or cycle.disconnected or cycle.flow.write_paused:
            return False
        if self._transport.is_closing():
            return False
        self._transport.write(chunk)
        self.num_writes += 1
        return True
