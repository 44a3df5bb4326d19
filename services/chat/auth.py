"""`Authorization: Bearer <key>` -> the caller (user id and tier), or Unauthenticated (401)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from services.chat.errors import Unauthenticated
from tandem.config import ApiKey


def current_user(request: Request) -> ApiKey:
    keys: dict[str, ApiKey] = request.app.state.chat.api_keys
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    caller = keys.get(token.strip()) if scheme.lower() == "bearer" else None
    if caller is None:
        raise Unauthenticated("a valid API key is required: send Authorization: Bearer <key>")
    return caller


CurrentUser = Annotated[ApiKey, Depends(current_user)]
