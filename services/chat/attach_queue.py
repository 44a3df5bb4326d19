"""The queue new streams' Redis reads wait in: at most `max_reads` at once, up to `max_waiting`
more waiting their turn for up to the caller's wait, and past that bound a new stream refused at
once with 503 `streams_busy` and a Retry-After. A reconnect storm (the clients of a chat instance
that died, all coming back at once) then waits its turn instead of taking every connection of the
Redis pool, whose commands fail after a short wait for one (tandem.runtime.REDIS_POOL_WAIT_S)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.chat import metrics
from services.chat.errors import Unavailable

RETRY_AFTER_S = 2.0


class StreamsBusy(Unavailable):
    """A new stream that found the attach queue full, or waited in it too long."""

    default_code = "streams_busy"
    default_retry_after_s = RETRY_AFTER_S


class AttachQueue:
    def __init__(self, max_reads: int, max_waiting: int) -> None:
        self._reads = asyncio.Semaphore(max_reads)
        self._max_waiting = max_waiting
        self.num_waiting = 0
        metrics.STREAM_ATTACH_WAITING.set_function(lambda: self.num_waiting)

    @contextlib.asynccontextmanager
    async def turn(self, wait_s: float) -> AsyncIterator[None]:
        """A read's turn, within `wait_s`; raises StreamsBusy when `max_waiting` wait already, or
        when the turn does not come in time."""
        if self._reads.locked():
            if self.num_waiting >= self._max_waiting:
                raise StreamsBusy(f"{self.num_waiting} new streams wait to attach on this instance; retry shortly")
            self.num_waiting += 1
            try:
                async with asyncio.timeout(wait_s):
                    await self._reads.acquire()
            except TimeoutError:
                raise StreamsBusy(f"a new stream waited {wait_s:.0f} s to attach on this instance; retry shortly") from None
            finally:
                self.num_waiting -= 1
        else:
            await self._reads.acquire()
        try:
            yield
        finally:
            self._reads.release()
