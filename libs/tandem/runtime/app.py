"""A service's FastAPI apps: the service's own (its API, whose lifespan owns the runtime) and its
ops app (/healthz, /readyz, /metrics, /version, and the service API's /docs, /redoc and
/openapi.json), which run_service serves on the internal ops port (tandem.runtime.ops_port): the
service's own port answers none of them. Every answer carries a request id
(tandem.runtime.request_id). An error is answered as `{"error": {"message", "type", "code",
"request_id"}}` and never carries an exception's text: that goes to the log under the request id.
A service may install its own handlers over these (the chat does)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as FrameworkHttpError
from starlette.types import ASGIApp

from tandem import __version__
from tandem.runtime.health import health_router
from tandem.runtime.metrics import metrics_router
from tandem.runtime.request_id import RequestIds, error_body, internal_error_response
from tandem.runtime.runtime import Runtime


class TandemApp(FastAPI):
    """A FastAPI app with request ids around everything, Starlette's own error handling included."""

    def build_middleware_stack(self) -> ASGIApp:
        return RequestIds(super().build_middleware_stack())


async def _answer_framework(_: Request, exc: Exception) -> JSONResponse:
    """The framework's refusals (no such route, wrong method): its detail is a fixed phrase."""
    assert isinstance(exc, FrameworkHttpError)
    body = error_body(
        f"http_{exc.status_code}", str(exc.detail), type_="invalid_request_error" if exc.status_code < 500 else "server_error"
    )
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _answer_invalid(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = exc.errors()
    where = ".".join(str(part) for part in problems[0]["loc"]) if problems else ""
    message = f"{where}: {problems[0]['msg']}" if problems else "invalid request"
    return JSONResponse(error_body("bad_request", message, type_="invalid_request_error"), status_code=400)


async def _answer_unexpected(_: Request, exc: Exception) -> JSONResponse:
    """A bug: the client gets the request id, the log the traceback (tandem.runtime.request_id)."""
    return internal_error_response()


def create_app(
    runtime: Runtime,
    *,
    routers: Sequence[APIRouter] = (),
    on_start: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> FastAPI:
    """A FastAPI app whose lifespan owns the runtime; `on_start`/`on_stop` add the service's own."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        if on_start is not None:
            await on_start()
        try:
            yield
        finally:
            runtime.begin_draining()  # already, when a signal stopped the server
            if on_stop is not None:
                await on_stop()
            await runtime.stop()

    # No schema or docs on the service's port: the ops app serves this app's.
    app = TandemApp(title=f"tandem {runtime.config.role}", version=__version__, lifespan=lifespan, openapi_url=None)
    app.state.runtime = runtime  # run_service drains it on SIGTERM and exits with its exit code
    _answer_errors(app)
    for router in routers:
        app.include_router(router)
    app.state.ops_app = ops_app(runtime, app)  # run_service serves it on the ops port
    return app


def ops_app(runtime: Runtime, service_app: FastAPI) -> FastAPI:
    """The ops port's app: health, readiness, metrics, the version, and `service_app`'s API schema
    with its /docs and /redoc (read when asked, so routes added after this are in it). No
    lifespan: the service app's owns the runtime."""
    app = TandemApp(title=f"tandem {runtime.config.role} (ops)", version=__version__)
    app.openapi = service_app.openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace the schema
    _answer_errors(app)
    app.include_router(health_router(runtime))
    app.include_router(metrics_router())

    @app.get("/version", tags=["health"])
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return app


def _answer_errors(app: FastAPI) -> None:
    app.add_exception_handler(FrameworkHttpError, _answer_framework)
    app.add_exception_handler(RequestValidationError, _answer_invalid)
    app.add_exception_handler(Exception, _answer_unexpected)
