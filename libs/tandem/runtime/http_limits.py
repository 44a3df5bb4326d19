"""What one client may hold of a service's HTTP server: a connection limit, and deadlines for a
request's headers and for its body.

uvicorn waits forever for a request's headers and body: a client that opens a connection and
sends its request a byte now and then (slowloris) holds a connection, a file descriptor and
parser state until it chooses to stop, and a few thousand such clients fill any server. Its
`limit_concurrency` answers past the limit with a bare 503 that has no Retry-After.

`LimitedHttpProtocol` is uvicorn's httptools protocol (the one services.chat.direct_write knows;
responses, streaming and flow control are untouched) with two timers per connection:
- the header timer runs from the connection's opening, or from the first byte of its next
  request, until that request's headers are complete;
- the body timer runs from the headers until the whole body has arrived (a total deadline, not
  one per chunk: a client cannot stretch the body by sending a byte just before each expiry).
When one fires, the connection is closed (counted in `tandem_http_connections_cut_total`). Once
a request is read, no timer runs: a response streamed for hours (SSE) is never cut. Between
requests, uvicorn's own keep-alive timeout closes an idle connection.
A pipelined request (sent before the previous answer ended) pauses reading until that answer
ends, so a body still arriving then can run out its deadline: browsers and HTTP clients do not
pipeline.

Past `max_connections` open connections (slow ones included: the timers bound how long those
last), a request is answered 503 `server_busy` with Retry-After and the connection closed,
before the app sees it."""

from __future__ import annotations

import asyncio
import logging
from asyncio import TimerHandle
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi.responses import JSONResponse
from prometheus_client import Counter
from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from tandem.runtime.request_id import RequestIds, error_body

log = logging.getLogger(__name__)

CONNECTIONS_CUT = Counter("tandem_http_connections_cut_total", "HTTP connections closed for a request read too slowly", ["reason"])
REQUESTS_OVER_LIMIT = Counter(
    "tandem_http_requests_over_limit_total", "HTTP requests answered 503 because the connection limit was reached"
)

# Room for the page, health checks and API calls beside the chat's streams, and the whole limit
# of the other services (their HTTP is health, metrics and a few internal calls).
SPARE_CONNECTIONS = 1024
BUSY_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float


def default_max_connections(role: str, max_streams: int) -> int:
    """The chat holds one connection per SSE stream: its limit must sit above `max_streams`, so
    that a stream past that gets the chat's own 503 (with its code) and not this one."""
    return max_streams + SPARE_CONNECTIONS if role == "chat" else SPARE_CONNECTIONS


def protocol_with(limits: HttpLimits) -> type[LimitedHttpProtocol]:
    """The protocol class to give uvicorn.Config(http=...): uvicorn builds one per connection
    from its own arguments, so the limits travel on the class, fixed when it is made."""
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": limits})


async def _busy(scope: Scope, receive: Receive, send: Send) -> None:
    body = error_body("server_busy", "the server is at its connection limit; try again shortly")
    headers = {"Retry-After": str(BUSY_RETRY_AFTER_S), "Connection": "close"}
    await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)


_answer_busy = RequestIds(_busy)  # the caller's X-Request-Id, or a new one, as every answer


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body deadlines and a connection limit."""

    limits: ClassVar[HttpLimits]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limit_concurrency = None  # uvicorn's own check: on_headers_complete does it instead
        self._header_timer: TimerHandle | None = None
        self._body_timer: TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._cut, "header_timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timers()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a later request on a kept-alive connection
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._cut, "header_timeout")

    def on_headers_complete(self) -> None:
        self._stop_timers()
        app = self.app
        if self._is_over_limit():
            REQUESTS_OVER_LIMIT.inc()
            self.app = _answer_busy
        try:
            super().on_headers_complete()
        finally:
            self.app = app
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._cut, "body_timeout")

    def on_message_complete(self) -> None:
        self._stop_timers()
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._stop_timers()  # the connection is the WebSocket protocol's from here
        super().handle_websocket_upgrade()

    def _is_over_limit(self) -> bool:
        # `connections` holds this one too; `tasks` the requests already running.
        max_connections = self.limits.max_connections
        return len(self.connections) > max_connections or len(self.tasks) >= max_connections

    def _stop_timers(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cut(self, reason: str) -> None:
        self._header_timer = self._body_timer = None
        if self.transport.is_closing():
            return
        CONNECTIONS_CUT.labels(reason=reason).inc()
        log.debug("closing the connection of %s: %s", self.client, reason)
        self.transport.close()
