"""The relay's side of the token stream: one durable pull consumer on JetStream, shared by every
relay, so each message reaches one of them and stays in the stream until it is acknowledged. A
message is one TokenEvent (a reply's subject, or a final's) or a worker's TokenBatch (a step's
events for all its replies: bus/token_batches.py); the handler gets its events as one list. A
message is acknowledged only after all its events are in the token log; when Redis fails on any
of them it is handed back whole (nak, redelivered after a short delay; the log drops the events it
already holds); a message that is not a TokenEvent or a TokenBatch is terminated, and so are a
batch's events that fail validation, one by one. A relay that dies leaves its unacknowledged events to be redelivered to another
relay, or to itself once restarted, after the ack wait.

The relay pulls continuously, as the newer NATS clients' `consume` does: one pull request for
`batch` events stays open at the server (`expires_s`), and the next is sent when half of it has
come, so an event costs the bus its delivery and its ack. A fetch per batch (nats-py's `fetch`)
sends a pull request per event whenever events come one at a time (a lone reply decoding): 41
for 40 such events, against one here (tests/integration/test_relay_consumer.py). The server's
idle heartbeats tell a live pull from a lost one (NATS restarted, its store lost, a request
dropped): when neither an event nor a heartbeat has come for MISSED_HEARTBEATS heartbeats, the
relay subscribes again. When the client reconnects (its NATS node lost, the client on another one
of the cluster), the relay asks again at once (`reconnected`) instead of waiting out the
heartbeats: a pull request sent through the lost node may be gone with it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from redis.exceptions import RedisError

from services.relay import metrics
from tandem.bus import subjects, validate
from tandem.bus.token_stream import STREAM, wait_for_token_stream
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)

# Appends one message's events, in order; raises RedisError/OSError when the log cannot take them.
HandleEvents = Callable[[list[TokenEvent]], Awaitable[None]]


class Redeliver(Exception):
    """The handler cannot take the event yet (a final event whose predecessors are not logged, so
    its output check cannot read its window): it is handed back and redelivered after `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(f"redeliver after {delay_s} s")
        self.delay_s = delay_s


MISSED_HEARTBEATS = 3  # heartbeats without a word from the server before the pull counts as lost
# The server's status answers on a pull request's inbox (JetStream's pull protocol).
_HEARTBEAT = "100"
_REQUEST_EXPIRED = "408"  # its Nats-Pending-Messages header: the events it asked for and did not get
_PENDING_MESSAGES = "Nats-Pending-Messages"


@dataclass(frozen=True)
class TokenConsumerConfig:
    durable: str = "relay"
    batch: int = 256  # events a pull request asks for; the next is sent when half have come
    expires_s: float = 30.0  # how long a pull request stays open at the server
    heartbeat_s: float = 1.0  # the server's idle heartbeat on an open pull request
    ack_wait_s: float = 3.0  # an event a relay took and did not acknowledge goes to another after this
    max_ack_pending: int = 100_000
    nak_delay_s: float = 0.5
    # After JetStream failed to answer, at an even pace: a cluster that lost a leader answers again
    # the moment its election ends (nats-server: 4-9 s), and a relay backing off would miss it by seconds.
    retry_s: float = 0.25
    first_answer_s: float = 0.5  # how long creating the consumer waits for JetStream, at first
    short_answers_s: float = 20.0  # ... for this long (two raft elections); then longer each try,
    max_answer_s: float = 4.0
    late_retry_s: float = 2.0  # ... and tries this far apart (a lasting refusal is not logged 4 times a second)


def consumer_config(config: TokenConsumerConfig) -> ConsumerConfig:
    """The relay's durable pull consumer, as every relay creates (or finds) it."""
    return ConsumerConfig(
        durable_name=config.durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=config.ack_wait_s,
        max_ack_pending=config.max_ack_pending,
        max_deliver=-1,
        filter_subjects=[subjects.TOKENS_ALL, subjects.FINALS_ALL],
    )


class _Inbox:
    """What the server sends to a pull's inbox, gathered as it comes, taken a batch at a time."""

    def __init__(self) -> None:
        self._messages: list[Msg] = []
        self._arrived = asyncio.Event()
        self.reconnected = False  # the client reconnected since the last take: pull again

    async def put(self, message: Msg) -> None:  # the subscription's callback
        self._messages.append(message)
        self._arrived.set()

    def wake_reconnected(self) -> None:
        self.reconnected = True
        self._arrived.set()

    async def take(self, timeout_s: float) -> list[Msg]:
        """Everything that came, waiting up to `timeout_s` for something; [] when nothing did (or
        the client reconnected meanwhile: `reconnected`)."""
        if not self._messages and not self.reconnected:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._arrived.wait()
        self._arrived.clear()
        messages, self._messages = self._messages, []
        return messages


class TokenConsumer:
    def __init__(self, client: Client, handle: HandleEvents, config: TokenConsumerConfig) -> None:
        self._client = client
        self._handle = handle
        self._config = config
        self._inbox: _Inbox | None = None
        self.is_running = False

    async def reconnected(self) -> None:
        """The client is connected again (nats-py's reconnected callback): the pull is sent again
        now, through the node the client is on."""
        if self._inbox is not None:
            self._inbox.wake_reconnected()

    async def run(self) -> None:
        """Consumes until cancelled. A pull that is lost or refused (NATS gone, the consumer or
        stream lost with a server's store) subscribes again."""
        while True:
            inbox = self._inbox = _Inbox()
            subscription = await self._subscribe(inbox)
            self.is_running = True
            try:
                await self._consume(subscription.subject, inbox)
            except Exception:  # never stop consuming for good
                log.exception("token stream: consuming failed; subscribing again")
            finally:
                self.is_running = False
                with contextlib.suppress(nats.errors.Error):
                    await subscription.unsubscribe()
            await asyncio.sleep(self._config.retry_s)

    async def _consume(self, inbox_subject: str, inbox: _Inbox) -> None:
        """Returns when the pull is lost: no word from the server for MISSED_HEARTBEATS heartbeats,
        or a status other than a heartbeat or an expiry (the consumer deleted, a conflict)."""
        requested = 0  # events asked for by the open pull requests and not yet come
        while True:
            if requested <= self._config.batch // 2:
                await self._pull(inbox_subject, self._config.batch - requested)
                requested = self._config.batch
            messages = await inbox.take(MISSED_HEARTBEATS * self._config.heartbeat_s)
            if inbox.reconnected:  # the open request may be lost with the node: ask afresh (more asked is harmless)
                inbox.reconnected = False
                log.info("token stream: reconnected; pulling again")
                requested = 0
            elif not messages:
                log.warning("token stream: no word from the server for %d heartbeats; subscribing again", MISSED_HEARTBEATS)
                return
            events = []
            for message in messages:
                status = message.headers.get(api.Header.STATUS) if message.headers else None
                if status is None:
                    events.append(message)
                elif status == _REQUEST_EXPIRED:
                    unmet = message.headers.get(_PENDING_MESSAGES)  # type: ignore[union-attr]
                    requested = max(0, requested - int(unmet)) if unmet is not None and unmet.isdigit() else 0
                elif status != _HEARTBEAT:
                    description = message.headers.get(api.Header.DESCRIPTION, "")  # type: ignore[union-attr]
                    log.warning("token stream: the pull was answered %s %s; subscribing again", status, description)
                    await self._take_all(events)
                    return
            requested = max(0, requested - len(events))
            # Each message on its own: the log orders their events, whatever order they finish in.
            await self._take_all(events)

    async def _take_all(self, events: list[Msg]) -> None:
        await asyncio.gather(*(self._take(message) for message in events))

    async def _pull(self, inbox_subject: str, batch: int) -> None:
        request = {
            "batch": batch,
            "expires": int(self._config.expires_s * 1e9),
            "idle_heartbeat": int(self._config.heartbeat_s * 1e9),
        }
        subject = f"{api.DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{STREAM}.{self._config.durable}"
        await self._client.publish(subject, json.dumps(request).encode(), reply=inbox_subject)

    async def _subscribe(self, inbox: _Inbox) -> Subscription:
        config = consumer_config(self._config)
        # A consumer without a leader (its node lost, the election under way) drops requests
        # unanswered: short waits for the answer, tried again at once, find the new leader soon after
        # it is elected (a request sent during the election is never answered). Past the longest
        # election, the wait grows: a JetStream that is only slow gets the time it needs.
        answer_s = self._config.first_answer_s
        grow_after_s = asyncio.get_running_loop().time() + self._config.short_answers_s
        while True:
            try:
                await wait_for_token_stream(self._client, self._config.retry_s, 1.0)  # `tandem bus init` makes it
                js = self._client.jetstream(timeout=answer_s)
                await js.add_consumer(STREAM, config)  # creates it, or brings an older one to these subjects
                return await self._client.subscribe(self._client.new_inbox(), cb=inbox.put)
            except (nats.errors.Error, TimeoutError) as exc:
                is_late = asyncio.get_running_loop().time() > grow_after_s
                pause_s = self._config.late_retry_s if is_late else self._config.retry_s
                log.warning("token stream: cannot consume yet (%s); retrying in %.2f s", exc, pause_s)
                await asyncio.sleep(pause_s)
                if is_late:
                    answer_s = min(2 * answer_s, self._config.max_answer_s)

    def _events_of(self, message: Msg) -> list[TokenEvent]:
        """The message's valid events (a batch's invalid ones dropped and counted); raises Invalid."""
        if not subjects.is_token_batch(message.subject):
            return [validate.token_event(message.data, message.subject)]
        events, invalid = validate.token_batch(message.data, message.subject)
        for exc in invalid:
            metrics.EVENTS_DROPPED.labels(why="bad").inc()
            validate.drop("token_event", message.subject, exc)
        return events

    async def _take(self, message: Msg) -> None:
        try:
            events = self._events_of(message)
            if events:
                await self._handle(events)
        except Redeliver as wait:
            await self._settle(message.nak(delay=wait.delay_s))
        except validate.Invalid as exc:
            metrics.EVENTS_DROPPED.labels(why="bad").inc()
            validate.drop("token_batch" if subjects.is_token_batch(message.subject) else "token_event", message.subject, exc)
            await self._settle(message.term())
        except ValueError as exc:  # the token log refuses it (tandem.tokenlog.writer)
            metrics.EVENTS_DROPPED.labels(why="bad").inc()
            log.warning("dropped a token event on %s: %s", message.subject, exc)
            await self._settle(message.term())
        except (RedisError, OSError) as exc:
            metrics.EVENTS_RETRIED.inc()
            log.warning("could not log the events on %s (%s); they will be redelivered", message.subject, exc)
            await self._settle(message.nak(delay=self._config.nak_delay_s))
        except Exception:  # a bug must not lose the event either
            metrics.EVENTS_RETRIED.inc()
            log.exception("could not log the events on %s; they will be redelivered", message.subject)
            await self._settle(message.nak(delay=self._config.nak_delay_s))
        else:
            await self._settle(message.ack())

    async def _settle(self, outcome: Awaitable[None]) -> None:
        try:
            await outcome
        except nats.errors.Error as exc:  # the connection went; the ack wait redelivers it
            log.warning("token stream: could not settle an event (%s)", exc)
