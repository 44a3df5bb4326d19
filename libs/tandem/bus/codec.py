"""Protobuf on the wire: every NATS payload is one message of a known type."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)


class BadMessage(ValueError):
    """A payload that is not a valid message of the expected type."""


def encode(message: Message) -> bytes:
    return message.SerializeToString()


def decode(data: bytes, message_type: type[M]) -> M:
    message = message_type()
    try:
        message.ParseFromString(data)
    except DecodeError:  # the parser's own words say no more than this, and name its internals
        raise BadMessage(f"not a valid {message_type.DESCRIPTOR.full_name} ({len(data)} bytes)") from None
    return message
