"""The relay's token consumer (services/relay/consumer.py) on a nats-server of its own: one pull
request stays open while events trickle in (not a request per event), and a pull lost with its
server, killed with -9 and started again on its port with its store, or frozen (SIGSTOP) and
thawed, is noticed from the missing heartbeats and pulled again, with every event handled."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from helpers import wait_until
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.relay.consumer import MISSED_HEARTBEATS, TokenConsumer, TokenConsumerConfig
from tandem.bus.token_stream import STREAM, ensure_token_stream
from tandem.devstack.servers import EmbeddedServer, start_nats
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.worker.token_publisher import publish_event

HEARTBEAT_S = 0.2
REPLY_ID = "chatcmpl-consumer-test"


class Nats:
    """A nats-server that a test may kill -9 and start again on its port, with its store."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.server: EmbeddedServer = start_nats(workdir)
        self.port = int(self.server.address.rsplit(":", 1)[1])

    def restart(self) -> None:
        self.server.child.process.kill()
        self.server.child.wait()
        self.server = start_nats(self.workdir, port=self.port)

    def stop(self) -> None:
        os.kill(self.server.pid, signal.SIGCONT)  # never leave it frozen
        self.server.stop()


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[Nats]:
    server = Nats(tmp_path)
    yield server
    server.stop()


async def _connect(url: str) -> Client:
    return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)


@pytest_asyncio.fixture
async def publisher(own_nats: Nats) -> AsyncIterator[Client]:
    client = await _connect(own_nats.server.url)
    await ensure_token_stream(client)
    yield client
    await client.close()


class Consumed:
    """A consumer run on its own connection, and the events its handler was given."""

    def __init__(self) -> None:
        self.seqs: list[int] = []

    async def handle(self, events: list[TokenEvent]) -> None:
        self.seqs.extend(event.seq for event in events)

    async def has_all(self, count: int) -> bool:
        return set(self.seqs) >= set(range(1, count + 1))


@pytest_asyncio.fixture
async def consumed(own_nats: Nats) -> AsyncIterator[Consumed]:
    client = await _connect(own_nats.server.url)
    result = Consumed()
    config = TokenConsumerConfig(heartbeat_s=HEARTBEAT_S, expires_s=30 * HEARTBEAT_S, retry_s=0.1)
    task = asyncio.create_task(TokenConsumer(client, result.handle, config).run())
    yield result
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await client.close()


def _event(seq: int) -> TokenEvent:
    return TokenEvent(reply_id=REPLY_ID, seq=seq, token_id=100 + seq, text=f"t{seq} ")


async def _connected(client: Client) -> bool:
    return client.is_connected


async def _publish(js_client: Client, seqs: range) -> None:
    js = js_client.jetstream()
    for seq in seqs:
        await publish_event(js, _event(seq), within_s=30)  # as a worker does: retried while JetStream comes back


@pytest_asyncio.fixture
async def pulls(own_nats: Nats) -> AsyncIterator[list[Msg]]:
    """The pull requests sent to the bus from before the consumer starts (requested before it)."""
    seen: list[Msg] = []

    async def count(msg: Msg) -> None:
        seen.append(msg)

    watcher = await _connect(own_nats.server.url)
    await watcher.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.>", cb=count)
    await watcher.flush()
    yield seen
    await watcher.close()


async def test_events_that_trickle_in_are_consumed_over_one_open_pull_request(own_nats, pulls, publisher, consumed):
    num_events = 40
    for seq in range(1, num_events + 1):  # one at a time, each consumed before the next is sent
        await _publish(publisher, range(seq, seq + 1))
        await wait_until(lambda seq=seq: consumed.has_all(seq), timeout_s=10)
    assert sorted(set(consumed.seqs)) == list(range(1, num_events + 1))
    # nats-py's fetch, the relay's pull before, sent 41 here.
    assert 1 <= len(pulls) <= 2, f"{len(pulls)} pull requests for {num_events} events"


async def test_a_pull_lost_with_a_server_killed_and_started_again_is_pulled_again_and_no_event_is_lost(own_nats, publisher, consumed):
    await _publish(publisher, range(1, 21))
    await wait_until(lambda: consumed.has_all(20), timeout_s=10)
    own_nats.restart()  # kill -9; the same port and store
    await wait_until(lambda: _connected(publisher), timeout_s=20)
    await _publish(publisher, range(21, 41))
    # The old pull went with the server: only a new one, sent once its heartbeats were missed, brings these.
    await wait_until(lambda: consumed.has_all(40), timeout_s=MISSED_HEARTBEATS * HEARTBEAT_S + 20)
    assert sorted(set(consumed.seqs)) == list(range(1, 41))


async def test_a_pull_whose_server_froze_is_pulled_again_once_it_thaws_and_no_event_is_lost(own_nats, publisher, consumed):
    await _publish(publisher, range(1, 11))
    await wait_until(lambda: consumed.has_all(10), timeout_s=10)
    os.kill(own_nats.server.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(MISSED_HEARTBEATS * HEARTBEAT_S * 3)  # the drill itself: frozen past the heartbeats
    finally:
        os.kill(own_nats.server.pid, signal.SIGCONT)
    await _publish(publisher, range(11, 31))
    await wait_until(lambda: consumed.has_all(30), timeout_s=20)
    assert sorted(set(consumed.seqs)) == list(range(1, 31))
