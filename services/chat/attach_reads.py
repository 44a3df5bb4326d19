"""The meta a new stream attaches with (whose reply it is, its model and route), read once per
reply however many streams ask at once: a reply this instance's feed reads already is answered
from memory (FanoutHub.running_meta); otherwise the first stream's read is shared by every stream
of the same reply that asks while it is under way (a single flight), and waits its turn in the
AttachQueue. A Redis that does not answer (no free connection in the pool, a restart) is asked
again until the stream's wait is up. The reply's backlog is read once as well: by its feed."""

from __future__ import annotations

import asyncio
import copy
from functools import partial

from redis.asyncio import Redis

from services.chat import metrics
from services.chat.attach_queue import AttachQueue, StreamsBusy
from services.chat.config import ChatConfig
from services.chat.fanout import FanoutHub
from tandem.tokenlog import ReplyMeta, load_reply
from tandem.tokenlog.reader import until_answered


class AttachReads:
    """`wait_s`: how long a stream waits for its read, its turn in `queue` included."""

    def __init__(self, redis: Redis, fanout: FanoutHub, queue: AttachQueue, wait_s: float) -> None:
        self._redis = redis
        self._fanout = fanout
        self._queue = queue
        self._wait_s = wait_s
        self._flights: dict[str, asyncio.Future[ReplyMeta | None]] = {}

    @classmethod
    def of(cls, redis: Redis, fanout: FanoutHub, config: ChatConfig) -> AttachReads:
        return cls(redis, fanout, AttachQueue(config.stream_attach_reads, config.stream_attach_queue), config.stream_attach_wait_s)

    async def meta(self, reply_id: str) -> ReplyMeta | None:
        """The reply's meta without its request; None when its log is gone. Raises StreamsBusy (a
        503) past the queue's bound or wait, LogUnavailable when Redis stays away."""
        running = self._fanout.running_meta(reply_id)
        if running is not None:
            metrics.STREAM_ATTACHES.labels("feed").inc()
            return running
        flight = self._flights.get(reply_id)
        if flight is None:
            metrics.STREAM_ATTACHES.labels("read").inc()
            flight = asyncio.ensure_future(self._read(reply_id))
            self._flights[reply_id] = flight
            flight.add_done_callback(partial(self._landed, reply_id))
        else:
            metrics.STREAM_ATTACHES.labels("shared").inc()
        try:
            return await asyncio.shield(flight)  # a stream that leaves does not cancel the others' read
        except Exception as exc:
            if isinstance(exc, StreamsBusy):  # each stream refused counts, also those that shared the read
                metrics.STREAMS_REFUSED.labels(exc.code).inc()
            raise copy.copy(exc) from exc  # each stream its own, so no traceback grows shared

    async def _read(self, reply_id: str) -> ReplyMeta | None:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self._wait_s
        async with self._queue.turn(self._wait_s):
            read = partial(load_reply, self._redis, reply_id, with_request=False)
            return await until_answered(read, max(0.0, give_up_at - loop.time()))

    def _landed(self, reply_id: str, flight: asyncio.Future[ReplyMeta | None]) -> None:
        if self._flights.get(reply_id) is flight:
            del self._flights[reply_id]
        if not flight.cancelled():
            flight.exception()  # retrieved: a read whose streams all left is not logged as lost
