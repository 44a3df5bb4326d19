"""The relay settles every reply's quota reservation (tandem.quota) as its log closes: it sees
every reply's final event, the workers' and its own (a reply lost after its continuations, a
cancelled reply no worker ended), so whoever ends a reply, the reply is settled here.

The cost is read from the logged final event (the one that closed the log, which is not always
the event whose append closed it: a final event held for a gap is logged when the gap fills).
A final event without usage (an error, or an end the relay wrote) is charged its prompt and the
tokens logged before it. Settling runs beside storing the turn and never holds it up; when Redis
fails it is not retried: the reservation expires, its units spent."""

from __future__ import annotations

import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from tandem.quota import TokenBuckets
from tandem.tokenlog import logged_events
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)


class QuotaSettler:
    def __init__(self, redis: Redis, buckets: TokenBuckets) -> None:
        self._redis = redis
        self._buckets = buckets

    async def settle(self, closing: TokenEvent) -> None:
        """Settles the reply whose log `closing` just closed; never raises for Redis."""
        reply_id = closing.reply_id
        try:
            events = await logged_events(self._redis, reply_id)
            final = events[-1] if events else closing
            back = await self._buckets.settle_final(reply_id, final.usage, num_output_tokens=max(0, final.seq - 1))
        except (RedisError, OSError, ValueError) as exc:  # ValueError: an unreadable log entry
            log.warning("reply %s: its quota reservation was not settled (%s); it expires", reply_id, exc)
            return
        if back is not None:
            log.debug("reply %s: settled its quota, %.1f units given back", reply_id, back)
