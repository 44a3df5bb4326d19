"""`Authorization: Bearer <key>` -> the caller (user id and tier), or Unauthenticated (401)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from services.chat.errors import Unauthenticated
from tandem.config import ApiKey


def caller(request: Request) -> ApiKey:
    """The request's caller (a dict lookup; no I/O)."""
    keys: dict[str, ApiKey] = request.app.state.chat.api_keys
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = keys.get(token.strip()) if scheme.lower() == "bearer" else None
    if key is None:
        raise Unauthenticated("a valid API key is required: send Authorization: Bearer <key>")
    return key


async def current_user(request: Request) -> ApiKey:
    """The dependency: async, so FastAPI calls it on the event loop, not in its thread pool (a
    thread hop per request costs a GIL handoff, milliseconds when the loop is busy streaming)."""
    return caller(request)


CurrentUser = Annotated[ApiKey, Depends(current_user)]
