"""Latency as a chat client sees it. Every request is stamped on arrival (StampArrival, outermost
but for the body limit); a request that starts a reply measures it with a ReplyClock: time to
first token when the first content is written to the client, inter-token latency between writes
of content, end-to-end latency at the final event, then the reply's outcome and tokens. A stream
that closes before its final event counts as "client_gone" (or "expired" when its log vanished).
Once a streamed reply ends, its longest pause: the longest gap after the first content, between
two writes of content or to the final event (or to the close of a stream that ended without it,
a client who gave up mid-pause included).

A whole (non-streamed) reply has no first token before its last: it counts in e2e, outcome and
tokens only. Resumed streams and second readers of a reply are not measured: their clock did not
start at the reply's request."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from services.chat import metrics
from tandem.bus.events import ReplyStatus, status_of_finish
from tandem.v1.tokens_pb2 import TokenEvent

OUTCOMES = {
    ReplyStatus.COMPLETE: "done",
    ReplyStatus.STOPPED: "cancelled",
    ReplyStatus.FAILED: "failed",
    ReplyStatus.MODERATED: "moderated",
}
_ARRIVED = "arrived_s"


class StampArrival:
    """Pure ASGI middleware: the request's arrival time (time.perf_counter) in its scope's state."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[_ARRIVED] = time.perf_counter()
        await self.app(scope, receive, send)


def arrival_s(request: Request) -> float:
    """When the request arrived (now, for an app built without StampArrival)."""
    return float(request.scope.get("state", {}).get(_ARRIVED, time.perf_counter()))


class ReplyClock:
    """One reply's latencies as its one client sees them; call `content` at each write that carries
    content, `final` with the final event once it is written, `close` however the response ends."""

    def __init__(self, tier: str, model: str, arrived_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self._labels = {"tier": tier, **metrics.model_labels(model)}
        self._arrived_s = arrived_s
        self._clock = clock
        self._last_content_s: float | None = None
        self._longest_pause_s = 0.0
        self._is_over = False

    def content(self) -> None:
        now_s = self._clock()
        if self._last_content_s is None:
            metrics.TIME_TO_FIRST_TOKEN.labels(**self._labels).observe(now_s - self._arrived_s)
        else:
            metrics.INTER_TOKEN_LATENCY.labels(**self._labels).observe(now_s - self._last_content_s)
            self._longest_pause_s = max(self._longest_pause_s, now_s - self._last_content_s)
        self._last_content_s = now_s

    def final(self, event: TokenEvent) -> None:
        """The reply's final event reached the client: its e2e latency, outcome and tokens."""
        if self._is_over:
            return
        self._is_over = True
        now_s = self._clock()
        self._observe_longest_pause(now_s)
        metrics.E2E_LATENCY.labels(**self._labels).observe(now_s - self._arrived_s)
        metrics.REPLIES.labels(outcome=OUTCOMES[status_of_finish(event.finish)], **self._labels).inc()
        metrics.PROMPT_TOKENS.labels(**self._labels).inc(event.usage.input_tokens)
        metrics.CACHED_TOKENS.labels(**self._labels).inc(event.usage.cached_tokens)
        metrics.OUTPUT_TOKENS.labels(**self._labels).inc(event.usage.output_tokens)

    def close(self, outcome: str = "client_gone") -> None:
        """The response ended; without a final event first, the reply counts as `outcome`."""
        if not self._is_over:
            self._is_over = True
            self._observe_longest_pause(self._clock())
            metrics.REPLIES.labels(outcome=outcome, **self._labels).inc()

    def _observe_longest_pause(self, end_s: float) -> None:
        """A streamed reply's longest pause, the wait up to its end included; none for a whole reply."""
        if self._last_content_s is not None:
            longest_s = max(self._longest_pause_s, end_s - self._last_content_s)
            metrics.LONGEST_PAUSE.labels(**self._labels).observe(longest_s)
