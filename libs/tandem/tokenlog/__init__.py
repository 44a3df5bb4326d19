"""The Redis-stream token log: every reply's TokenEvents in order, resumable from any seq.
The relay writes it (writer.py); any edge reads it (reader.py; tail.py reads many logs over a few connections). A reply's status and the
clock it is stamped with are tandem.bus.events'."""

from tandem.tokenlog.continuation import Continuation, TakenOver, begin_continuation, fence_reply
from tandem.tokenlog.keys import REPLY_SET_TTL_S, RUNNING, RUNNING_REPLY_TTL_S, UNPERSISTED, ReplyKeys
from tandem.tokenlog.meta import ReplyMeta, create_reply, load_reply, load_reply_states, set_answered
from tandem.tokenlog.reader import LogUnavailable, ReplyGone, logged_events, read
from tandem.tokenlog.readers import attach, detach, idle_for_ms
from tandem.tokenlog.tail import LogTail, TailConfig, TailSink
from tandem.tokenlog.values import as_bytes, as_text
from tandem.tokenlog.writer import Appended, TokenLogWriter

__all__ = [
    "REPLY_SET_TTL_S",
    "RUNNING",
    "RUNNING_REPLY_TTL_S",
    "UNPERSISTED",
    "Appended",
    "Continuation",
    "LogTail",
    "LogUnavailable",
    "ReplyGone",
    "ReplyKeys",
    "ReplyMeta",
    "TailConfig",
    "TailSink",
    "TakenOver",
    "TokenLogWriter",
    "as_bytes",
    "as_text",
    "attach",
    "begin_continuation",
    "create_reply",
    "detach",
    "fence_reply",
    "idle_for_ms",
    "load_reply",
    "load_reply_states",
    "logged_events",
    "read",
    "set_answered",
]
