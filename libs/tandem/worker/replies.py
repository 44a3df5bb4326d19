"""The replies a worker holds, and where each one's stream stands.

A worker holds a reply from the moment it accepts it until the reply's final event (or its
handoff) is published: queued, prefilling, decoding, or on its way to a decode worker. Its
heartbeat claims every one of them, so the relay leaves them alone; a reply nobody claims that
stops streaming is continued elsewhere. A streamed reply knows the sequence number of its next
event and the owner epoch its events carry (the assignment's)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

_ENDED_REMEMBERED = 4096  # ended streams whose next seq is kept, for a cancel racing their end


@dataclass
class ReplyStream:
    next_seq: int
    epoch: int


class HeldReplies:
    def __init__(self) -> None:
        self._streams: dict[str, ReplyStream] = {}  # replies whose tokens this worker publishes
        self._held: set[str] = set()  # replies held outside the stream (a handoff after its prefill)
        self._ended: OrderedDict[str, int] = OrderedDict()  # reply id -> the next seq of its ended stream
        self._is_released = False  # the worker gave up on all of them (it broke, or stopped)
        self._none_held = asyncio.Event()
        self._none_held.set()

    # -- streams --------------------------------------------------------------------------------

    def stream(self, reply_id: str, first_seq: int, epoch: int) -> ReplyStream:
        """Starts (or restarts, for a retried assignment) the reply's stream at `first_seq`."""
        stream = self._streams[reply_id] = ReplyStream(first_seq, epoch)
        self._changed()
        return stream

    def stream_of(self, reply_id: str) -> ReplyStream | None:
        return None if self._is_released else self._streams.get(reply_id)

    def end_stream(self, reply_id: str, stream: ReplyStream | None = None) -> None:
        """Ends the reply's stream (only `stream` itself, when given: a later one replaced it)."""
        if stream is None or self._streams.get(reply_id) is stream:
            ended = self._streams.pop(reply_id, None)
            if ended is not None:
                self._ended[reply_id] = ended.next_seq
                self._ended.move_to_end(reply_id)
                while len(self._ended) > _ENDED_REMEMBERED:
                    self._ended.popitem(last=False)
            self._changed()

    def next_seq(self, reply_id: str) -> int | None:
        """The seq the reply's next event takes: after every event its stream numbered (published,
        or being published), also shortly after the stream ended; None when it never streamed here."""
        stream = self._streams.get(reply_id)
        return stream.next_seq if stream is not None else self._ended.get(reply_id)

    def is_streaming(self, reply_id: str) -> bool:
        return reply_id in self._streams

    # -- holds ----------------------------------------------------------------------------------

    def hold(self, reply_id: str) -> None:
        self._held.add(reply_id)
        self._changed()

    def let_go(self, reply_id: str) -> None:
        self._held.discard(reply_id)
        self._changed()

    # -- claims ---------------------------------------------------------------------------------

    def claimed(self) -> list[str]:
        """Every reply this worker will finish, for its heartbeat; none once released."""
        if self._is_released:
            return []
        return sorted(self._held.union(self._streams))

    def release_all(self) -> None:
        """Claims nothing from now on and publishes nothing more: another worker continues them."""
        self._is_released = True
        self._none_held.set()

    async def wait_none_held(self, timeout_s: float) -> bool:
        """True once every held reply has ended, False after `timeout_s`."""
        try:
            await asyncio.wait_for(self._none_held.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _changed(self) -> None:
        if self._streams or self._held:
            self._none_held.clear()
        else:
            self._none_held.set()
