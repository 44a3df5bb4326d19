"""What the relay does with one delivery from the token stream, a single event or a worker's batch:
its events go into their replies' logs in one pipelined Redis call (tandem.tokenlog.writer), each
reply's in order, and every event then meets the same hooks (metrics, the output check's
`after_append`, a finished reply's store and quota settling).

With a replication config asking for replicas (redis_wait_replicas), a call's appends count only
once that many replicas hold them (tandem.tokenlog.replicated: WAIT on the call's connection);
fewer in time raises NotReplicated and the delivery comes back, but the hooks of what did land on
the primary run at once, since its redelivery is answered as duplicates.

Final events that the output check must see first (`admit_final` reads the window their
predecessors left in the log) are appended after the other events of the delivery, in a second
call. A final whose predecessors are not all logged yet still lets the rest of the delivery in,
then raises Redeliver: the whole delivery comes back, and the log drops what it already holds."""

from __future__ import annotations

from collections.abc import Callable

from redis.asyncio import Redis

from services.relay import metrics
from services.relay.consumer import Redeliver
from services.relay.moderation import OutputModerator
from tandem.bus.events import is_final
from tandem.tokenlog import Appended, TokenLogWriter
from tandem.tokenlog.replicated import NotReplicated, ReplicationConfig, on_replicas
from tandem.v1.tokens_pb2 import TokenEvent

OnFinished = Callable[[TokenEvent], None]  # a final event that closed its reply's log


class LogAppender:
    def __init__(
        self,
        writer: TokenLogWriter,
        moderator: OutputModerator | None,
        on_finished: OnFinished,
        replication: ReplicationConfig | None = None,
    ) -> None:
        self._writer = writer
        self._moderator = moderator
        self._on_finished = on_finished
        self._replication = replication or ReplicationConfig()

    async def append(self, events: list[TokenEvent]) -> None:
        """Raises RedisError/OSError when the log cannot take them, Redeliver when a final event
        must wait for its predecessors: either way the delivery is redelivered."""
        if self._moderator is None:
            await self._append_all(events)
            return
        await self._append_all([event for event in events if not is_final(event)])
        admitted: list[TokenEvent] = []
        wait: Redeliver | None = None
        for event in filter(is_final, events):
            try:
                if await self._moderator.admit_final(event):
                    admitted.append(event)
                else:
                    metrics.EVENTS_DROPPED.labels(why="moderated").inc()  # the reply ended as moderated instead
            except Redeliver as exc:
                wait = exc
        await self._append_all(admitted)
        if wait is not None:
            raise wait

    async def _append_all(self, events: list[TokenEvent]) -> None:
        if not events:
            return

        async def write(client: Redis) -> list[Appended]:
            if len(events) == 1:
                return [await self._writer.append(events[0], on=client)]
            return await self._writer.append_many(events, on=client)

        try:
            results = await on_replicas(self._writer.redis, self._replication, write)
        except NotReplicated as short:
            if isinstance(short.written, list):  # on the primary: its redelivery will be duplicates
                for event, result in zip(events, short.written, strict=True):
                    self._after_append(event, result)
            raise
        for event, result in zip(events, results, strict=True):
            self._after_append(event, result)

    def _after_append(self, event: TokenEvent, appended: Appended) -> None:
        if appended.is_stale:
            metrics.EVENTS_DROPPED.labels(why="stale").inc()
        elif appended.num_appended == 0:
            metrics.EVENTS_DROPPED.labels(why="duplicate_or_held").inc()
        metrics.EVENTS_LOGGED.inc(appended.num_appended)
        if appended.final_status is not None:
            metrics.REPLIES_FINISHED.labels(status=appended.final_status.value).inc()
            self._on_finished(event)
        if self._moderator is not None:
            self._moderator.after_append(event, appended)
