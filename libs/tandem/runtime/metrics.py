"""GET /metrics: the process's Prometheus metrics in the text format."""

from __future__ import annotations

from fastapi import APIRouter, Response

from tandem import metrics


def metrics_router() -> APIRouter:
    router = APIRouter(tags=["metrics"])

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return router
