"""The chat service's errors. Domain code raises these (never an HTTP exception); one handler
answers each, and the errors of the libraries the service uses, in OpenAI's shape plus the
request id, `{"error": {"message", "type", "code", "param", "request_id"}}`, with Retry-After
where waiting helps. A message is for people and never repeats a library's exception text (it
can name hosts, drivers and internals): that goes to the log under the request id."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as FrameworkHttpError

from tandem.models.chat_template import ChatTemplateError
from tandem.runtime.request_id import current_request_id, error_body
from tandem.store import StoreUnavailable

log = logging.getLogger(__name__)


class ChatError(Exception):
    """What the client is told: `message` says what to do, `code` is a stable machine name
    (each kind has its own default), `param` the request field at fault, if one is."""

    default_code = "error"
    default_retry_after_s = 0.0

    def __init__(self, message: str, *, code: str = "", param: str | None = None, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.retry_after_s = retry_after_s or self.default_retry_after_s


class InvalidRequest(ChatError):
    default_code = "invalid_request"


class Moderated(InvalidRequest):
    """A message the input check refused (services.chat.moderation): a 400 like any bad input."""

    default_code = "moderated"


class Unauthenticated(ChatError):
    default_code = "invalid_api_key"


class NotFound(ChatError):
    """Also what another user's conversation or message is: its existence is not disclosed."""

    default_code = "not_found"


class Conflict(ChatError):
    default_code = "conflict"


class Gone(ChatError):
    default_code = "gone"


class TooLarge(ChatError):
    default_code = "too_large"


class RateLimited(ChatError):
    """Over a limit of the caller's own (its token quota, its open streams): always answered with
    a Retry-After saying when the limit lets the request through."""

    default_code = "rate_limit_exceeded"
    default_retry_after_s = 1.0


class Unavailable(ChatError):
    """Worth retrying: always answered with a Retry-After."""

    default_code = "unavailable"
    default_retry_after_s = 1.0


STATUS: dict[type[ChatError], int] = {
    InvalidRequest: 400,
    Unauthenticated: 401,
    NotFound: 404,
    Conflict: 409,
    Gone: 410,
    TooLarge: 413,
    RateLimited: 429,
    Unavailable: 503,
}
TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
}


def error_response(status: int, error: ChatError) -> JSONResponse:
    type_ = TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = error_body(error.code, error.message, type_=type_, param=error.param)
    headers = {"Retry-After": str(max(1, round(error.retry_after_s)))} if error.retry_after_s else {}
    if isinstance(error, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=status, headers=headers)


def as_chat_error(exc: Exception) -> ChatError:
    """The service's own error for one raised by a library it uses."""
    if isinstance(exc, ChatError):
        return exc
    if isinstance(exc, StoreUnavailable):
        log.warning("request %s: store unavailable: %s", current_request_id(), exc)
        return Unavailable("the conversation store is unavailable; try again shortly", code="store_unavailable", retry_after_s=2.0)
    if isinstance(exc, RedisError):  # a token log or quota read while Redis restarts
        log.warning("request %s: redis unavailable: %s: %s", current_request_id(), type(exc).__name__, exc)
        return Unavailable("the token log is unavailable; try again shortly", code="token_log_unavailable", retry_after_s=2.0)
    if isinstance(exc, ChatTemplateError):
        return InvalidRequest(f"the model's chat template rejects these messages: {exc}", code="bad_messages", param="messages")
    if isinstance(exc, RequestValidationError):
        problems = exc.errors()
        if not problems:
            return InvalidRequest("invalid request", code="bad_request")
        where = ".".join(str(part) for part in problems[0]["loc"] if part not in ("body", "query", "header", "path"))
        what = str(problems[0]["msg"])
        return InvalidRequest(f"{where}: {what}" if where else what, code="bad_request", param=where or None)
    raise TypeError(f"no chat error stands for {type(exc).__name__}") from exc


async def answer(_: Request, exc: Exception) -> JSONResponse:
    error = as_chat_error(exc)
    status = next((status for kind, status in STATUS.items() if isinstance(error, kind)), 500)
    return error_response(status, error)


async def answer_framework(_: Request, exc: Exception) -> JSONResponse:
    """The framework's own refusals (no such route, wrong method), in the same shape."""
    assert isinstance(exc, FrameworkHttpError)
    return error_response(exc.status_code, ChatError(str(exc.detail), code=f"http_{exc.status_code}"))


def install(app: FastAPI) -> None:
    for kind in (ChatError, StoreUnavailable, RedisError, ChatTemplateError, RequestValidationError):
        app.add_exception_handler(kind, answer)
    app.add_exception_handler(FrameworkHttpError, answer_framework)
