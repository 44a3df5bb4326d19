"""`Authorization: Bearer <key>` -> the caller (user id and tier), or 401."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from tandem.config import ApiKey


def current_user(request: Request) -> ApiKey:
    keys: dict[str, ApiKey] = request.app.state.chat.api_keys
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    caller = keys.get(token.strip()) if scheme.lower() == "bearer" else None
    if caller is None:
        raise HTTPException(
            status_code=401,
            detail="a valid API key is required: send Authorization: Bearer <key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return caller


CurrentUser = Annotated[ApiKey, Depends(current_user)]
