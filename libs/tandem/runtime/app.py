"""A service's FastAPI app: its lifespan owns the runtime, and every app answers /healthz,
/readyz and /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from tandem import __version__
from tandem.runtime.health import health_router
from tandem.runtime.metrics import metrics_router
from tandem.runtime.runtime import Runtime


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
            runtime.is_draining = True
            if on_stop is not None:
                await on_stop()
            await runtime.stop()

    app = FastAPI(title=f"tandem {runtime.config.role}", version=__version__, lifespan=lifespan)
    app.include_router(health_router(runtime))
    app.include_router(metrics_router())
    for router in routers:
        app.include_router(router)
    return app
