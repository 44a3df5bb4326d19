"""Token events travel on NATS JetStream. The stream `TANDEM_TOKENS` keeps every event published
on `tandem.v1.tokens.>` (workers) or `tandem.v1.finals.>` (a failure the router or a relay ends a
reply with) until a relay acknowledges it, which a relay does only after the event is
in its reply's token log: a relay that dies, or a Redis that blinks, costs a redelivery, never an
event. Workers publish with `publish_token`, routers and relays with `publish_final`; core NATS
subscribers of both subjects see every event.

Each event carries a message id (reply, epoch, seq), so a publish retried after a lost
acknowledgement is stored once; the token log drops duplicates anyway."""

from __future__ import annotations

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from tandem.bus import subjects
from tandem.bus.codec import encode
from tandem.bus.events import is_final
from tandem.v1.tokens_pb2 import TokenEvent

STREAM = "TANDEM_TOKENS"
DEFAULT_MAX_AGE_S = 600
PUBLISH_TIMEOUT_S = 2.0
_DUPLICATE_WINDOW_S = 120
_STREAM_NAME_IN_USE = 10058  # JetStream's error code: the stream exists with another configuration


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
    await _publish(js, subjects.tokens(event.reply_id), event, timeout_s)


async def publish_final(js: JetStreamContext, event: TokenEvent, timeout_s: float = PUBLISH_TIMEOUT_S) -> None:
    """Publishes a final event that no worker sends (the router's or a relay's failure), as
    `publish_token` does, on the reply's finals subject."""
    if not is_final(event):
        raise ValueError(f"event {event.seq} of {event.reply_id} is not final")
    await _publish(js, subjects.final(event.reply_id), event, timeout_s)


async def _publish(js: JetStreamContext, subject: str, event: TokenEvent, timeout_s: float) -> None:
    await js.publish(
        subject,
        encode(event),
        timeout=timeout_s,
        stream=STREAM,
        headers={"Nats-Msg-Id": message_id(event)},
    )
