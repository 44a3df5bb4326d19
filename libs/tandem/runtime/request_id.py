"""Every HTTP request has an id: the caller's X-Request-Id when it is a sane one, else a fresh one.
It is answered in the X-Request-Id header and in every error body, and the log says what went
wrong under it, so a client's report finds the details while the client sees none of them.

A pure ASGI middleware wrapped around the whole app (outside Starlette's own error handling), so
even an unexpected exception's answer carries the id, and streamed answers are never buffered."""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

HEADER = "X-Request-Id"
_SANE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # a caller's id we repeat: no spaces, quotes or control bytes
_current: ContextVar[str] = ContextVar("request_id", default="")
INTERNAL_ERROR = "internal_error"
INTERNAL_MESSAGE = "something went wrong on our side; try again, and quote the request id if it persists"
# scope["state"][SERVER_SEND]: the server's own `send`, under every middleware's. The middlewares
# act on a response's start message only, so the body of a long stream may skip them.
SERVER_SEND = "tandem.server_send"


def current_request_id() -> str:
    """The id of the request being answered ("" outside one)."""
    return _current.get()


def request_id_from(value: str | None) -> str:
    """The caller's id when it is sane, else a new one."""
    if value is not None and _SANE.fullmatch(value):
        return value
    return uuid.uuid4().hex


def error_body(code: str, message: str, *, type_: str = "server_error", **extra: object) -> dict[str, object]:
    """Tandem's error body: OpenAI's shape, plus the request id. `code` is stable, `message` for people."""
    return {"error": {"message": message, "type": type_, "code": code, **extra, "request_id": current_request_id()}}


def internal_error_response() -> JSONResponse:
    return JSONResponse(error_body(INTERNAL_ERROR, INTERNAL_MESSAGE), status_code=500)


class RequestIds:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((value for name, value in scope["headers"] if name == b"x-request-id"), None)
        request_id = request_id_from(incoming.decode("latin-1") if incoming is not None else None)
        token = _current.set(request_id)
        scope.setdefault("state", {})[SERVER_SEND] = send
        is_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # answered already (the app's 500 handler) or cut short mid-stream
            log.exception("request %s: %s %s failed", request_id, scope.get("method", ""), scope.get("path", ""))
            if not is_started:
                await internal_error_response()(scope, receive, send_with_id)
        finally:
            _current.reset(token)
