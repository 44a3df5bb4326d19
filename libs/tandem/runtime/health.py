"""/healthz (the process is alive) and /readyz (its dependencies are up: 503 naming the failing
checks otherwise)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from tandem.runtime.runtime import Runtime


def health_router(runtime: Runtime) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "role": runtime.config.role}

    @router.get("/readyz")
    async def readyz(response: Response) -> dict[str, object]:
        checks = await runtime.readiness()
        is_ready = all(checks.values())
        response.status_code = 200 if is_ready else 503
        return {"ready": is_ready, "checks": checks}

    return router
