"""`Authorization: Bearer <key>` -> the caller (user id and tier), or Unauthenticated (401)."""

from __future__ import annotations

from fastapi import Request

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
