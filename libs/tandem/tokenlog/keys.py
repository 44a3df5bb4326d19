"""Redis key names of one reply, the two sets that list replies, and their expiries. Every key of
a reply shares the `{reply_id}` hash tag, so a Redis Cluster keeps them in one slot. The append
script also moves a reply from RUNNING to UNPERSISTED as it closes the log, atomically, which
needs one Redis (or a cluster whose scripts may touch several slots), as Tandem runs today."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "tandem:reply"
RUNNING = "tandem:replies:running"  # every reply create_reply recorded and no final event has closed
UNPERSISTED = "tandem:replies:unpersisted"  # closed replies whose assistant turn is not stored yet

# Nothing in Redis lives without an expiry. A running reply's keys get settings.running_reply_ttl_s
# (this is its default, for callers without settings), pushed back by every event; the sets of
# replies are refreshed whenever written, and the relay's sweep drops members that are gone.
RUNNING_REPLY_TTL_S = 3600
REPLY_SET_TTL_S = 86400
READERS_TTL_S = 3600  # a reader lease's sorted set outlives any lease


@dataclass(frozen=True)
class ReplyKeys:
    reply_id: str

    @property
    def log(self) -> str:
        """Stream of TokenEvents; entry id `<seq>-1`."""
        return f"{PREFIX}:{{{self.reply_id}}}:log"

    @property
    def pending(self) -> str:
        """Hash seq -> event, for events that arrived before the one before them."""
        return f"{PREFIX}:{{{self.reply_id}}}:pending"

    @property
    def meta(self) -> str:
        """Hash: who asked, for which conversation, status, times, the request, last logged seq, owner epoch."""
        return f"{PREFIX}:{{{self.reply_id}}}:meta"

    @property
    def readers(self) -> str:
        """Sorted set reader id -> lease expiry (unix ms) of every client streaming the reply."""
        return f"{PREFIX}:{{{self.reply_id}}}:readers"

    def all(self) -> tuple[str, ...]:
        return (self.log, self.pending, self.meta, self.readers)
