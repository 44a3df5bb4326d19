"""Token events onto JetStream, retried for a bounded time. A publish that still fails after
PUBLISH_RETRY_S of a connected bus means this worker cannot deliver its replies: it raises
CannotPublish, and the worker gives up its replies (another worker continues them) and exits.
Time during which the NATS server itself does not answer (stopped, frozen, restarting) does not
count against that bound, so an outage of the whole bus does not make every worker exit; it
counts against NATS_OUTAGE_S. So does a full stream (it refuses new events until relays catch
up): the worker backs off and retries, its replies pause."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from tandem.bus.token_batches import publish_batch
from tandem.bus.token_stream import STREAM, find_token_stream, is_stream_full, publish_token
from tandem.v1.tokens_pb2 import TokenBatch, TokenEvent

log = logging.getLogger(__name__)
T = TypeVar("T")

# Long enough to ride out the election of a new stream leader when a clustered node dies:
# nats-server's raft waits 4-9 s (fixed in its code) before a follower campaigns; two rounds.
PUBLISH_RETRY_S = 20.0
NATS_OUTAGE_S = 120.0  # a bus away longer than this: the worker gives up as when it cannot publish
OPEN_STREAM_RETRY_S = 30.0
_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 0.25  # a stream without a leader refuses at once; its new one answers the moment it is elected


class CannotPublish(Exception):
    """Token events cannot reach JetStream (no stream, no server) within the retry bound."""


async def _always_up() -> bool:
    return True


def server_answers(client: Client, timeout_s: float = 1.0) -> BusProbe:
    """A probe of the NATS server itself: False while it does not answer a JetStream API request
    (stopped, frozen, reconnecting). A request, not `flush`: nats-py's flush that times out leaves
    a PONG future behind whose late answer kills the client's read loop."""
    js = client.jetstream(timeout=timeout_s)

    async def probe() -> bool:
        if not client.is_connected:
            return False
        try:
            await js.account_info()
        except (nats.errors.Error, TimeoutError):
            return False
        return True

    return probe


BusProbe = Callable[[], Awaitable[bool]]


async def _with_retries(what: str, attempt: Callable[[], Awaitable[T]], within_s: float, bus_is_up: BusProbe = _always_up) -> T:
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + within_s
    backoff_s = _FIRST_BACKOFF_S
    while True:
        try:
            return await attempt()
        except nats.errors.Error as exc:
            if is_stream_full(exc) or not await bus_is_up():
                # The server itself does not answer (NATS stopped, frozen or reconnecting), or the
                # stream is full until relays catch up: not this worker's failure, so it does not
                # count against `within_s`.
                deadline = max(deadline, loop.time() + within_s)
            if loop.time() >= min(deadline, started + NATS_OUTAGE_S):
                raise CannotPublish(f"{what}: {type(exc).__name__} {exc}") from exc
            log.warning("%s failed (%s); retrying in %.2f s", what, type(exc).__name__, backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, _MAX_BACKOFF_S)


async def open_token_stream(client: Client, within_s: float = OPEN_STREAM_RETRY_S) -> JetStreamContext:
    """The token stream, once it exists: the admin step makes it, never a worker. CannotPublish
    after `within_s` without it (the worker exits; its supervisor starts it again)."""
    return await _with_retries(
        f"finding the token stream {STREAM} (`tandem bus init` creates it)", lambda: find_token_stream(client), within_s
    )


async def publish_event(
    js: JetStreamContext, event: TokenEvent, within_s: float = PUBLISH_RETRY_S, bus_is_up: BusProbe = _always_up
) -> None:
    """Publishes `event` and waits for JetStream to store it, retrying with backoff; CannotPublish
    after `within_s` during which the server answered (`bus_is_up`, e.g. server_answers) and
    JetStream still did not store it. JetStream stores a retried event once (its message id)."""
    await _with_retries(f"publishing event {event.seq} of {event.reply_id}", lambda: publish_token(js, event), within_s, bus_is_up)


async def publish_events(
    js: JetStreamContext, batch: TokenBatch, message_id: str, within_s: float = PUBLISH_RETRY_S, bus_is_up: BusProbe = _always_up
) -> None:
    """Publishes a batch of events as `publish_event` publishes one, every retry with the same
    `message_id`, so JetStream stores it once."""
    what = f"publishing a batch of {len(batch.events)} events ({message_id})"
    await _with_retries(what, lambda: publish_batch(js, batch, message_id), within_s, bus_is_up)
