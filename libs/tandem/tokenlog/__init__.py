"""The Redis-stream token log: every reply's TokenEvents in order, resumable from any seq.
The relay writes it (writer.py); any edge reads it (reader.py). A reply's status and the
clock it is stamped with are tandem.bus.events'."""

from tandem.tokenlog.keys import RUNNING, UNPERSISTED, ReplyKeys
from tandem.tokenlog.meta import ReplyMeta, create_reply, load_reply
from tandem.tokenlog.reader import ReplyGone, logged_events, read
from tandem.tokenlog.readers import attach, detach, idle_for_ms
from tandem.tokenlog.values import as_bytes, as_text
from tandem.tokenlog.writer import Appended, TokenLogWriter

__all__ = [
    "RUNNING",
    "UNPERSISTED",
    "Appended",
    "ReplyGone",
    "ReplyKeys",
    "ReplyMeta",
    "TokenLogWriter",
    "as_bytes",
    "as_text",
    "attach",
    "create_reply",
    "detach",
    "idle_for_ms",
    "load_reply",
    "logged_events",
    "read",
]
