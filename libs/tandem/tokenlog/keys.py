"""Redis key names of one reply. Every key of a reply shares the `{reply_id}` hash tag, so a
Redis Cluster keeps them in one slot and the append script can touch them all."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "tandem:reply"
RUNNING = "tandem:replies:running"  # replies a chat client started and is tracking readers of
UNPERSISTED = "tandem:replies:unpersisted"  # finished replies whose assistant turn is not yet stored


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
        """Hash: who asked, for which conversation, status, times, the request, last logged seq."""
        return f"{PREFIX}:{{{self.reply_id}}}:meta"

    @property
    def readers(self) -> str:
        """Sorted set reader id -> lease expiry (unix ms) of every client streaming the reply."""
        return f"{PREFIX}:{{{self.reply_id}}}:readers"

    def all(self) -> tuple[str, ...]:
        return (self.log, self.pending, self.meta, self.readers)
