"""The relay's side of the token stream: one durable pull consumer on JetStream, shared by every
relay, so each event reaches one of them and stays in the stream until it is acknowledged. An
event is acknowledged only after its append to the token log succeeded; when Redis fails it is
handed back (nak, redelivered after a short delay); a message that is not a TokenEvent is
terminated. A relay that dies leaves its unacknowledged events to be redelivered to another
relay, or to itself once restarted, after the ack wait."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from redis.exceptions import RedisError

from services.relay import metrics
from tandem.bus import subjects, validate
from tandem.bus.token_stream import STREAM, ensure_token_stream
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)

HandleEvent = Callable[[TokenEvent], Awaitable[None]]  # raises RedisError/OSError when the log cannot take it


class Redeliver(Exception):
    """The handler cannot take the event yet (a final event whose predecessors are not logged, so
    its output check cannot read its window): it is handed back and redelivered after `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(f"redeliver after {delay_s} s")
        self.delay_s = delay_s


@dataclass(frozen=True)
class TokenConsumerConfig:
    max_age_s: float  # settings.token_stream_max_age_s
    durable: str = "relay"
    batch: int = 256
    fetch_timeout_s: float = 1.0  # how long one fetch waits for events; also how soon a stop is seen
    ack_wait_s: float = 3.0  # an event a relay took and did not acknowledge goes to another after this
    max_ack_pending: int = 100_000
    nak_delay_s: float = 0.5
    retry_s: float = 1.0  # after JetStream failed to answer


class TokenConsumer:
    def __init__(self, client: Client, handle: HandleEvent, config: TokenConsumerConfig) -> None:
        self._client = client
        self._handle = handle
        self._config = config
        self.is_running = False

    async def run(self) -> None:
        """Consumes until cancelled. A fetch that fails for another reason than having nothing to
        fetch (NATS gone, the consumer or stream lost with a server's store) subscribes again."""
        while True:
            subscription = await self._subscribe()
            self.is_running = True
            try:
                await self._consume(subscription)
            except Exception:  # never stop consuming for good
                log.exception("token stream: consuming failed; subscribing again")
            finally:
                self.is_running = False
                with contextlib.suppress(nats.errors.Error):
                    await subscription.unsubscribe()
            await asyncio.sleep(self._config.retry_s)

    async def _consume(self, subscription: nats.js.JetStreamContext.PullSubscription) -> None:
        """Returns when fetching fails."""
        while True:
            try:
                messages = await subscription.fetch(self._config.batch, timeout=self._config.fetch_timeout_s)
            except TimeoutError:  # nats' own, or asyncio's from inside fetch
                continue  # nothing to do for a while
            except nats.errors.Error as exc:
                log.warning("token stream: fetch failed (%s); subscribing again in %.1f s", exc, self._config.retry_s)
                return
            # Each event on its own: the log orders them, whatever order they finish in.
            await asyncio.gather(*(self._take(message) for message in messages))

    async def _subscribe(self) -> nats.js.JetStreamContext.PullSubscription:
        config = ConsumerConfig(
            durable_name=self._config.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self._config.ack_wait_s,
            max_ack_pending=self._config.max_ack_pending,
            max_deliver=-1,
            filter_subjects=[subjects.TOKENS_ALL, subjects.FINALS_ALL],
        )
        while True:
            try:
                js = await ensure_token_stream(self._client, self._config.max_age_s)
                await js.add_consumer(STREAM, config)  # creates it, or brings an older one to these subjects
                return await js.pull_subscribe_bind(durable=self._config.durable, stream=STREAM)
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("token stream: cannot consume yet (%s); retrying in %.1f s", exc, self._config.retry_s)
                await asyncio.sleep(self._config.retry_s)

    async def _take(self, message: Msg) -> None:
        try:
            event = validate.token_event(message.data, message.subject)
            await self._handle(event)
        except Redeliver as wait:
            await self._settle(message.nak(delay=wait.delay_s))
        except validate.Invalid as exc:
            metrics.EVENTS_DROPPED.labels(why="bad").inc()
            validate.drop("token_event", message.subject, exc)
            await self._settle(message.term())
        except ValueError as exc:  # the token log refuses it (tandem.tokenlog.writer)
            metrics.EVENTS_DROPPED.labels(why="bad").inc()
            log.warning("dropped a token event on %s: %s", message.subject, exc)
            await self._settle(message.term())
        except (RedisError, OSError) as exc:
            metrics.EVENTS_RETRIED.inc()
            log.warning("could not log an event of reply %s (%s); it will be redelivered", subjects.reply_id_of(message.subject), exc)
            await self._settle(message.nak(delay=self._config.nak_delay_s))
        except Exception:  # a bug must not lose the event either
            metrics.EVENTS_RETRIED.inc()
            log.exception("could not log an event of reply %s; it will be redelivered", subjects.reply_id_of(message.subject))
            await self._settle(message.nak(delay=self._config.nak_delay_s))
        else:
            await self._settle(message.ack())

    async def _settle(self, outcome: Awaitable[None]) -> None:
        try:
            await outcome
        except nats.errors.Error as exc:  # the connection went; the ack wait redelivers it
            log.warning("token stream: could not settle an event (%s)", exc)
