"""A request body over `max_body_bytes` is refused with 413 before the app reads it in full and
before anything else happens, authentication included: at once when Content-Length declares
too much (the body is never read), else (a chunked body) as soon as the bytes the app has
received pass the limit, so no body is buffered whole just to be refused.

A pure ASGI middleware, installed outermost: it sees every route's request first."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.chat.errors import TooLarge, error_response


class _BodyTooLarge(Exception):
    """Raised into the app's read of a chunked body once it passes the limit (already answered)."""


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared_bytes = _content_length(scope)
        if declared_bytes is not None and declared_bytes > self.max_body_bytes:
            await self._refuse(scope, receive, send)
            return
        num_received = 0
        is_refused = False
        is_response_started = False

        async def counted_receive() -> Message:
            nonlocal num_received, is_refused
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_body_bytes:
                    if not is_response_started:  # else the server can only drop the connection
                        is_refused = True
                        await self._refuse(scope, receive, send)
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal is_response_started
            if is_refused:  # the app's own answer to the failed read: the 413 was the answer
                return
            if message["type"] == "http.response.start":
                is_response_started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except _BodyTooLarge:
            if not is_refused:
                raise

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = TooLarge(f"the request body is larger than {self.max_body_bytes} bytes, the most accepted", code="body_too_large")
        response = error_response(413, refusal)
        response.headers["Connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    """The declared body size; None when not declared (chunked) or unreadable (the server
    refuses a malformed Content-Length itself)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
