"""Token events travel on NATS JetStream. The stream `TANDEM_TOKENS` keeps every event published
on `tandem.v1.tokens.>` (workers) or `tandem.v1.finals.>` (a failure the router or a relay ends a
reply with) until a relay acknowledges it, which a relay does only after the event is
in its reply's token log: a relay that dies, or a Redis that blinks, costs a redelivery, never an
event. Workers publish with `publish_token`, routers and relays with `publish_final`; core NATS
subscribers of both subjects see every event.

The stream is made by an admin step, `tandem bus init` (`ensure_token_stream`, with the
operator's login), never by a service: a service waits for it (`wait_for_token_stream`), and the
bus refuses any service role's stream create, update or delete (tandem.bus.permissions), so a
configuration set by hand is not reverted by the next service to connect. Full (its byte limit),
the stream refuses new events instead of dropping old ones: publishers see `refused` and back off.

Each event carries a message id (reply, epoch, seq), so a publish retried after a lost
acknowledgement is stored once; the token log drops duplicates anyway.

Every publish is counted by outcome, and a stored one timed to JetStream's acknowledgement: a
reply's events are published one after the other, each awaiting its acknowledgement, so a slow
or refusing JetStream holds every reply back (the publisher's backpressure, which the alerts of
deploy/prometheus/ watch)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, NoStreamResponseError, NotFoundError
from prometheus_client import Counter, Histogram

from tandem.bus import subjects
from tandem.bus.codec import encode
from tandem.bus.events import is_final
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)

STREAM = "TANDEM_TOKENS"
# A day: a relay or Redis outage overnight, until someone is paged and fixes it, loses nothing;
# the byte limit, not the age, is what bounds the stream's disk.
DEFAULT_MAX_AGE_S = 86400
DEFAULT_MAX_BYTES = 1 << 30
PUBLISH_TIMEOUT_S = 2.0
ADMIN_TIMEOUT_S = 2.0  # a clustered stream's create waits for its replicas' placement; tandem bus init retries a timeout
_DUPLICATE_WINDOW_S = 120
_STREAM_NAME_IN_USE = 10058  # JetStream's error code: the stream exists with another configuration
_STREAM_STORE_FAILED = 10077  # JetStream's error code for a publish it cannot store: the stream is full

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


@dataclass(frozen=True)
class TokenStreamConfig:
    """What `tandem bus init` makes of the stream (settings token_stream_*): its replicas (at most
    the cluster's nodes), the bytes it may hold and how long an event waits for a relay."""

    num_replicas: int = 1
    max_bytes: int = DEFAULT_MAX_BYTES
    max_age_s: float = DEFAULT_MAX_AGE_S


def token_stream_config(config: TokenStreamConfig = TokenStreamConfig()) -> StreamConfig:
    """A work queue: an event leaves the stream when a relay acknowledges it, or after
    `max_age_s`. Full (`max_bytes`), it refuses new events (DiscardPolicy.NEW) rather than drop
    old ones no relay took yet: publishers see `refused` and retry, the alert fires."""
    return StreamConfig(
        name=STREAM,
        subjects=[subjects.TOKENS_ALL, subjects.FINALS_ALL],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        max_bytes=config.max_bytes,
        max_age=float(config.max_age_s),
        num_replicas=config.num_replicas,
        duplicate_window=float(_DUPLICATE_WINDOW_S),
    )


async def ensure_token_stream(client: Client, config: TokenStreamConfig = TokenStreamConfig()) -> JetStreamContext:
    """Creates the stream, or brings an existing one to this configuration. The admin step's
    (`tandem bus init`, tandem.ops.bus_init): only the operator's bus user may; services wait
    for the stream with `wait_for_token_stream`."""
    js = client.jetstream(timeout=ADMIN_TIMEOUT_S)
    stream = token_stream_config(config)
    try:
        await js.add_stream(stream)
    except BadRequestError as exc:
        if exc.err_code != _STREAM_NAME_IN_USE:
            raise
        await js.update_stream(stream)
    return js


async def find_token_stream(client: Client) -> JetStreamContext:
    """The JetStream context to publish or consume with, once the stream exists; raises
    nats.js.errors.NotFoundError while it does not, another nats error when JetStream fails."""
    js = client.jetstream(timeout=PUBLISH_TIMEOUT_S)
    await js.stream_info(STREAM)
    return js


async def wait_for_token_stream(client: Client, retry_s: float = 1.0, max_retry_s: float = 5.0) -> JetStreamContext:
    """`find_token_stream`, retried with backoff until the stream exists and JetStream answers,
    saying each time what makes it (a service never creates the stream). The caller bounds it
    (a worker) or stays not ready meanwhile (router, relay)."""
    delay_s = retry_s
    while True:
        try:
            return await find_token_stream(client)
        except NotFoundError:
            log.warning("the token stream %s does not exist: `tandem bus init` creates it; retrying in %.1f s", STREAM, delay_s)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("the token stream is not available yet (%s); retrying in %.1f s", type(exc).__name__, delay_s)
        await asyncio.sleep(delay_s)
        delay_s = min(2 * delay_s, max_retry_s)


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


def is_stream_full(exc: BaseException) -> bool:
    """JetStream refused a publish because the stream holds its byte limit (DiscardPolicy.NEW):
    the bus is behind, not the publisher; it clears as relays acknowledge."""
    return isinstance(exc, APIError) and exc.err_code == _STREAM_STORE_FAILED


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
