"""The web page at `/`: plain HTML, CSS and JS served from static/ (vendored libraries in static/vendor/)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

STATIC = Path(__file__).parent / "static"
_MEDIA_TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".css": "text/css"}
# Every servable file, found once: a request names one of these or gets 404 (no path is joined).
_ASSETS = {path.relative_to(STATIC).as_posix(): path for path in STATIC.rglob("*") if path.suffix in _MEDIA_TYPES}
router = APIRouter(tags=["web"])


# Defence in depth behind the Markdown sanitiser: only the page's own files may run or style it
# (no inline script or event handler, no other origin), and images only from the page itself.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    headers = {"Cache-Control": "no-cache", "Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff"}
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=headers)


@router.get("/static/{name:path}", include_in_schema=False)
async def asset(name: str) -> Response:
    path = _ASSETS.get(name)
    if path is None:
        return Response(status_code=404)
    return FileResponse(path, media_type=_MEDIA_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})
