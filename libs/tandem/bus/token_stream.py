"""Token events travel on NATS JetStream. The stream `TANDEM_TOKENS` keeps every event published
on `tandem.v1.tokens.>` (workers) or `tandem.v1.finals.>` (a failure the router or a relay ends a
reply with) until a relay acknowledges it, which a relay does only after the event is
in its reply's token log: a relay that dies, or a Redis that blinks, costs a redelivery, never an
event. Workers publish with `publish_token`, routers and relays with `publish_final`; core NATS
subscribers of both subjects see every event.

Each event carries a message id (reply, epoch, seq), so a publish retried after a lost
acknowledgement is stored once; the token log drops duplicates anyway.

Every publish is counted by outcome, and a stored one timed to JetStream's acknowledgement: a
reply's events are published one after the other, each awaiting its acknowledgement, so a slow
or refusing JetStream holds every reply back (the publisher's backpressure, which the alerts of
deploy/prometheus/ watch)."""

from __future__ import annotations

import time

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, NoStreamResponseError
from prometheus_client import Counter, Histogram

from tandem.bus import subjects
from tandem.bus.codec import encode
from tandem.bus.events import is_final
from tandem.v1.tokens_pb2 import TokenEvent

STREAM = "TANDEM_TOKENS"
DEFAULT_MAX_AGE_S = 600
PUBLISH_TIMEOUT_S = 2.0
_DUPLICATE_WINDOW_S = 120
_STREAM_NAME_IN_USE = 10058  # JetStream's error code: the stream exists with another configuration

PUBLISHES = Counter(
    "tandem_bus_publishes_total",
    "Publishes to the token stream by kind (token, final) and outcome: stored, timeout, no_stream, refused, error",
    ["kind", "outcome"],
)
PUBLISH_SECONDS = Histogram(
    "tandem_bus_publish_seconds",
    "From a publish to the token stream to JetStream's acknowledgement that it stored the event, by kind",
    ["kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)


def token_stream_config(max_age_s: float = DEFAULT_MAX_AGE_S) -> StreamConfig:
    """A work queue: an event leaves the stream when a relay acknowledges it, or after `max_age_s`."""
    return StreamConfig(
        name=STREAM,
        subjects=[subjects.TOKENS_ALL, subjects.FINALS_ALL],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=float(max_age_s),
        duplicate_window=float(_DUPLICATE_WINDOW_S),
    )


async def ensure_token_stream(client: Client, max_age_s: float = DEFAULT_MAX_AGE_S) -> JetStreamContext:
    """Creates the stream, or brings an existing one to this configuration; every process that
    publishes or consumes tokens calls it at connect, so their start order does not matter."""
    js = client.jetstream(timeout=PUBLISH_TIMEOUT_S)
    config = token_stream_config(max_age_s)
    try:
        await js.add_stream(config)
    except BadRequestError as exc:
        if exc.err_code != _STREAM_NAME_IN_USE:
            raise
        await js.update_stream(config)
    return js


def message_id(event: TokenEvent) -> str:
    return f"{event.reply_id}:{event.epoch}:{event.seq}"


async def publish_token(js: JetStreamContext, event: TokenEvent, timeout_s: float = PUBLISH_TIMEOUT_S) -> None:
    """Publishes one event and waits for JetStream to store it. Raises nats.errors.TimeoutError,
    nats.errors.NoRespondersError (no stream: nothing would deliver it) or another nats error; the
    caller retries or says it cannot publish."""
    await _publish(js, "token", subjects.tokens(event.reply_id), event, timeout_s)


async def publish_final(js: JetStreamContext, event: TokenEvent, timeout_s: float = PUBLISH_TIMEOUT_S) -> None:
    """Publishes a final event that no worker sends (the router's or a relay's failure), as
    `publish_token` does, on the reply's finals subject."""
    if not is_final(event):
        raise ValueError(f"event {event.seq} of {event.reply_id} is not final")
    await _publish(js, "final", subjects.final(event.reply_id), event, timeout_s)


async def _publish(js: JetStreamContext, kind: str, subject: str, event: TokenEvent, timeout_s: float) -> None:
    started_s = time.perf_counter()
    try:
        await js.publish(
            subject,
            encode(event),
            timeout=timeout_s,
            stream=STREAM,
            headers={"Nats-Msg-Id": message_id(event)},
        )
    except nats.errors.Error as exc:
        PUBLISHES.labels(kind=kind, outcome=publish_failure(exc)).inc()
        raise
    PUBLISH_SECONDS.labels(kind=kind).observe(time.perf_counter() - started_s)
    PUBLISHES.labels(kind=kind, outcome="stored").inc()


def publish_failure(exc: nats.errors.Error) -> str:
    """Why JetStream did not store a publish: `timeout` (no acknowledgement in time: JetStream too
    slow, or the server away), `no_stream` (no stream takes the subject), `refused` (JetStream
    answered with an error, e.g. the stream is full) or `error` (the connection: closed,
    reconnecting, its buffer full)."""
    if isinstance(exc, nats.errors.TimeoutError):
        return "timeout"
    if isinstance(exc, NoStreamResponseError):
        return "no_stream"
    if isinstance(exc, APIError):
        return "refused"
    return "error"
