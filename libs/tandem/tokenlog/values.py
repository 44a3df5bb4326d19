"""What Tandem's Redis clients answer: bytes, since none of them decodes responses, although
redis-py types every answer as `bytes | str`. These say so once, and fail loudly for a client
set up to decode (a token event is binary and would not survive it)."""

from __future__ import annotations


def as_bytes(value: bytes | str) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError("Tandem's Redis clients must not decode responses (decode_responses=False)")
    return value


def as_text(value: bytes | str) -> str:
    return as_bytes(value).decode()
