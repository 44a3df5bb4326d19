"""Token events onto JetStream, retried for a bounded time. A publish that still fails after
PUBLISH_RETRY_S of a connected bus means this worker cannot deliver its replies: it raises
CannotPublish, and the worker gives up its replies (another worker continues them) and exits.
Time the bus spends disconnected (NATS restarting) does not count against that bound, so an
outage of the whole bus does not make every worker exit; it counts against NATS_OUTAGE_S."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from tandem.bus.token_stream import ensure_token_stream, publish_token
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)
T = TypeVar("T")

PUBLISH_RETRY_S = 5.0
NATS_OUTAGE_S = 120.0  # a bus away longer than this: the worker gives up as when it cannot publish
OPEN_STREAM_RETRY_S = 30.0
_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0


class CannotPublish(Exception):
    """Token events cannot reach JetStream (no stream, no server) within the retry bound."""


def _always_connected() -> bool:
    return True


async def _with_retries(
    what: str, attempt: Callable[[], Awaitable[T]], within_s: float, is_connected: Callable[[], bool] = _always_connected
) -> T:
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + within_s
    backoff_s = _FIRST_BACKOFF_S
    while True:
        was_connected = is_connected()
        try:
            return await attempt()
        except nats.errors.Error as exc:
            now = loop.time()
            if not (was_connected and is_connected()):
                deadline = max(deadline, now + within_s)  # the bus is away: its outage is not this worker's failure
            if now + backoff_s > min(deadline, started + NATS_OUTAGE_S):
                raise CannotPublish(f"{what}: {type(exc).__name__} {exc}") from exc
            log.warning("%s failed (%s); retrying in %.2f s", what, type(exc).__name__, backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, _MAX_BACKOFF_S)


async def open_token_stream(client: Client, max_age_s: float, within_s: float = OPEN_STREAM_RETRY_S) -> JetStreamContext:
    return await _with_retries("creating the token stream", lambda: ensure_token_stream(client, max_age_s), within_s)


async def publish_event(
    js: JetStreamContext, event: TokenEvent, within_s: float = PUBLISH_RETRY_S, is_connected: Callable[[], bool] = _always_connected
) -> None:
    """Publishes `event` and waits for JetStream to store it, retrying with backoff; CannotPublish
    after `within_s` of a connected bus (`is_connected`). JetStream stores a retried event once
    (its message id)."""
    await _with_retries(f"publishing event {event.seq} of {event.reply_id}", lambda: publish_token(js, event), within_s, is_connected)
