"""Every error the chat service answers has one shape, OpenAI's:
`{"error": {"message", "type", "code", "param"}}`, with Retry-After where waiting helps."""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from services.chat.replies import ReplyRefused
from tandem.models.chat_template import ChatTemplateError
from tandem.store import StoreUnavailable

log = logging.getLogger(__name__)

TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}


def error_response(status: int, message: str, code: str, retry_after_s: float = 0.0, param: str | None = None) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": TYPE_OF_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "code": code,
            "param": param,
        }
    }
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s else {}
    return JSONResponse(body, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail), f"http_{exc.status_code}")
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        return error_response(400, f"{where}: {first['msg']}" if where else first["msg"], "bad_request", param=where or None)

    @app.exception_handler(StoreUnavailable)
    async def store_down(_: Request, exc: StoreUnavailable) -> JSONResponse:
        log.warning("store unavailable: %s", exc)
        return error_response(503, f"the conversation store is unavailable ({exc}); try again shortly", "store_unavailable", 2.0)

    @app.exception_handler(ChatTemplateError)
    async def bad_messages(_: Request, exc: ChatTemplateError) -> JSONResponse:
        return error_response(400, f"the model's chat template rejects these messages: {exc}", "bad_messages", param="messages")

    @app.exception_handler(ReplyRefused)
    async def refused(_: Request, exc: ReplyRefused) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.code, exc.retry_after_s)
