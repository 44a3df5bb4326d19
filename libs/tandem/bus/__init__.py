"""NATS: the connection helper, the subject names and protobuf encode/decode."""

from tandem.bus.codec import BadMessage, decode, encode
from tandem.bus.connection import Bus, BusConfig

__all__ = ["BadMessage", "Bus", "BusConfig", "decode", "encode"]
