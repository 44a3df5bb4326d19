"""Every finished reply's outcome, published on `tandem.v1.outcomes` once the relay has stored it
(or found nothing to store): the served model that wrote it, its time to first token, whether it
ended in an error and whether it was a shadow. The routers compare a rollout's versions by these
and roll a failing candidate back (services/router).

Best effort, on core NATS: an outcome lost to a bus outage only thins the routers' window for a
moment, while holding up a store write for it would hold up the user's turn. A failed publish is
logged and counted, never raised. A reply whose store write is retried publishes once it is
stored, so an outcome may come late, never before the reply is saved."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from nats.errors import Error as NatsError

from services.relay import metrics
from tandem.bus import encode, subjects
from tandem.bus.events import is_final, now_ms
from tandem.tokenlog import ReplyMeta
from tandem.v1.common_pb2 import FINISH_REASON_ERROR
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.v1.worker_pb2 import ReplyOutcome

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], Awaitable[None]]


def ttft_s(meta: ReplyMeta, first: TokenEvent | None) -> float:
    """From the reply's creation to its first logged event's production; 0 when no token came
    (an error or an end the relay wrote before any) or a clock is missing."""
    if first is None or not first.produced_unix_ms or not meta.created_ms:
        return 0.0
    if is_final(first) and first.finish == FINISH_REASON_ERROR and not first.text:
        return 0.0
    return max(0.0, (first.produced_unix_ms - meta.created_ms) / 1000)


def reply_outcome(meta: ReplyMeta, *, shadow_of: str, first: TokenEvent | None, final: TokenEvent | None) -> ReplyOutcome:
    """`first` and `final`: the reply's first and last logged events (None: its log is gone)."""
    return ReplyOutcome(
        reply_id=meta.reply_id,
        model=(final.model if final is not None else "") or meta.model,  # a final the relay or router wrote names none
        ttft_s=ttft_s(meta, first),
        is_error=final is not None and final.finish == FINISH_REASON_ERROR,
        is_shadow=bool(shadow_of),
        finished_unix_ms=meta.finished_ms or now_ms(),
    )


class OutcomePublisher:
    def __init__(self, publish: Publish) -> None:
        """`publish(subject, data)`: a core NATS publish (the relay's bus client)."""
        self._publish = publish

    async def publish(self, outcome: ReplyOutcome) -> None:
        """Never raises for the bus: a lost outcome is logged and counted."""
        try:
            await self._publish(subjects.OUTCOMES, encode(outcome))
        except (NatsError, OSError) as exc:
            metrics.OUTCOMES.labels(result="failed").inc()
            log.warning("reply %s: its outcome was not published (%s: %s)", outcome.reply_id, type(exc).__name__, exc)
            return
        metrics.OUTCOMES.labels(result="published").inc()
