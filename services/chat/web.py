"""The web page at `/`: plain HTML, CSS and JS served from static/."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

STATIC = Path(__file__).parent / "static"
router = APIRouter(tags=["web"])

_TYPES = {
    "app.js": "text/javascript",
    "api.js": "text/javascript",
    "messages.js": "text/javascript",
    "stream.js": "text/javascript",
    "style.css": "text/css",
}


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/static/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in _TYPES:
        return Response(status_code=404)
    return FileResponse(STATIC / name, media_type=_TYPES[name], headers={"Cache-Control": "no-cache"})
