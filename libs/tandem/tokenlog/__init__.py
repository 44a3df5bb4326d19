"""The Redis-stream token log: every reply's TokenEvents in order, resumable from any seq.
The relay writes it (writer.py); any edge reads it (reader.py)."""

from tandem.tokenlog.keys import RUNNING, UNPERSISTED, ReplyKeys
from tandem.tokenlog.meta import ReplyMeta, ReplyStatus, create_reply, load_reply, now_ms, status_of_finish
from tandem.tokenlog.reader import ReplyGone, logged_events, read
from tandem.tokenlog.readers import attach, detach, idle_for_ms
from tandem.tokenlog.writer import Appended, TokenLogWriter

__all__ = [
    "RUNNING",
    "UNPERSISTED",
    "Appended",
    "ReplyGone",
    "ReplyKeys",
    "ReplyMeta",
    "ReplyStatus",
    "TokenLogWriter",
    "attach",
    "create_reply",
    "detach",
    "idle_for_ms",
    "load_reply",
    "logged_events",
    "now_ms",
    "read",
    "status_of_finish",
]
