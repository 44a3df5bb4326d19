"""A worker's token events travel in batches: one TokenBatch per publish on
`tandem.v1.tokens.batch.<worker_id>`, carrying every event the worker's step produced for all its
replies (each reply's in seq order), so a step of 64 replies costs the bus one publish and one
acknowledgement, and the relay one delivery, one acknowledgement and one pipelined Redis call,
instead of 64 of each (bench/token_path.py measures it).

A batch's message id is the publisher's (a random id per publisher, so a restarted worker never
reuses one inside JetStream's duplicate window) and the batch's number: stable across the retries
of one batch, so JetStream stores a retried batch once; the token log drops a duplicate event
anyway. Finals the router or a relay ends a reply with stay single events (token_stream.py)."""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from tandem.bus import subjects
from tandem.bus.codec import decode, encode
from tandem.bus.token_stream import PUBLISH_SECONDS, PUBLISH_TIMEOUT_S, PUBLISHES, STREAM, publish_failure
from tandem.v1.tokens_pb2 import TokenBatch, TokenEvent

MAX_BATCH_EVENTS = 1024  # events in one batch; validate.MAX_BATCH_EVENTS is the protocol's (higher) bound
MAX_BATCH_BYTES = 512 << 10  # well under NATS's default max_payload (1 MiB)


class BatchNumbers:
    """Message ids for one publisher's batches: `<worker>:<random>:<n>`."""

    def __init__(self, worker_id: str) -> None:
        self._prefix = f"{worker_id}:{secrets.token_hex(6)}"
        self._numbers = itertools.count(1)

    def next_id(self) -> str:
        return f"{self._prefix}:{next(self._numbers)}"


def batches(worker_id: str, events: Iterable[TokenEvent]) -> Iterator[TokenBatch]:
    """`events` (in order) cut into batches of at most MAX_BATCH_EVENTS events and about
    MAX_BATCH_BYTES; publishing them one after the other keeps every reply's order."""
    batch = TokenBatch(worker_id=worker_id)
    num_bytes = 0
    for event in events:
        size = event.ByteSize()
        if batch.events and (len(batch.events) >= MAX_BATCH_EVENTS or num_bytes + size > MAX_BATCH_BYTES):
            yield batch
            batch = TokenBatch(worker_id=worker_id)
            num_bytes = 0
        batch.events.append(event)
        num_bytes += size
    if batch.events:
        yield batch


async def publish_batch(js: JetStreamContext, batch: TokenBatch, message_id: str, timeout_s: float = PUBLISH_TIMEOUT_S) -> None:
    """Publishes a batch and waits for JetStream to store it; raises as publish_token does. A
    retry passes the same `message_id`."""
    started_s = time.perf_counter()
    try:
        await js.publish(
            subjects.token_batch(batch.worker_id),
            encode(batch),
            timeout=timeout_s,
            stream=STREAM,
            headers={"Nats-Msg-Id": message_id},
        )
    except nats.errors.Error as exc:
        PUBLISHES.labels(kind="batch", outcome=publish_failure(exc)).inc()
        raise
    PUBLISH_SECONDS.labels(kind="batch").observe(time.perf_counter() - started_s)
    PUBLISHES.labels(kind="batch", outcome="stored").inc()


def events_in(message: Msg) -> list[TokenEvent]:
    """The token events of a message seen on `tandem.v1.tokens.>` or `tandem.v1.finals.>`, for a
    watcher (a tool, a test) that is not the relay: a batch's, or the one event. Unchecked (the
    relay checks what it logs: validate.py); raises BadMessage."""
    if subjects.is_token_batch(message.subject):
        return list(decode(message.data, TokenBatch).events)
    return [decode(message.data, TokenEvent)]


OnEvent = Callable[[TokenEvent], Awaitable[None]]


class TokenWatch:
    """Core NATS subscriptions that see token events as they are published (not through the
    stream, so they take nothing from the relay): one reply's, or every reply's."""

    def __init__(self, subscriptions: list[Subscription]) -> None:
        self._subscriptions = subscriptions

    async def unsubscribe(self) -> None:
        for subscription in self._subscriptions:
            await subscription.unsubscribe()


async def watch_events(client: Client, on_event: OnEvent, reply_id: str | None = None) -> TokenWatch:
    """Calls `on_event` with every event of `reply_id` (every reply's when None) published from
    now on, single or in a worker's batch, finals included, each reply's in the order published."""

    async def on_message(message: Msg) -> None:
        for event in events_in(message):
            if reply_id is None or event.reply_id == reply_id:
                await on_event(event)

    if reply_id is None:
        singles = [f"{subjects.PREFIX}.tokens.*", subjects.FINALS_ALL]
    else:
        singles = [subjects.tokens(reply_id), subjects.final(reply_id)]
    return TokenWatch([await client.subscribe(subject, cb=on_message) for subject in [*singles, subjects.TOKEN_BATCHES_ALL]])
