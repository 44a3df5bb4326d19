"""A worker's token publisher on a nats-server of its own: a frozen server (SIGSTOP) is a bus
outage the publisher waits out, not a reason for the worker to give up; a server that answers
while JetStream does not store the event (no stream) is. Each publish is counted by its outcome
(tandem_bus_publishes_total), the stored ones timed (tandem_bus_publish_seconds): what the bus
backpressure alerts read."""

import asyncio
import os
import signal

import nats
import pytest
import pytest_asyncio
from helpers import freeze
from prometheus_client import REGISTRY

from tandem.bus.token_stream import STREAM, ensure_token_stream
from tandem.devstack.servers import start_nats
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.worker.token_publisher import CannotPublish, publish_event, server_answers

RETRY_S = 1.0


def publishes(outcome: str) -> float:
    return REGISTRY.get_sample_value("tandem_bus_publishes_total", {"kind": "token", "outcome": outcome}) or 0.0


def publishes_timed() -> float:
    return REGISTRY.get_sample_value("tandem_bus_publish_seconds_count", {"kind": "token"}) or 0.0


@pytest.fixture
def own_nats(tmp_path):
    server = start_nats(tmp_path)
    yield server
    os.kill(server.pid, signal.SIGCONT)  # never leave it frozen
    server.stop()


@pytest_asyncio.fixture
async def client(own_nats):
    nc = await nats.connect(own_nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    yield nc
    await nc.close()


def _state(pid: int) -> str:
    """The process's state letter (T: stopped), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


async def _keep_frozen(pid: int) -> None:
    """SIGSTOP again and again, so nothing else thaws it before the test does: twice in a full
    suite the server answered while meant to be frozen, which a stray SIGCONT would explain (our
    guess: another test's cleanup signalling a pid this server has reused; pid_max is 32768)."""
    while True:
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(0.05)


async def test_an_event_published_while_the_server_is_frozen_is_stored_once_it_thaws(own_nats, client):
    js = await ensure_token_stream(client)
    timeouts, stored, timed = publishes("timeout"), publishes("stored"), publishes_timed()
    freeze(own_nats.pid)
    freezer = asyncio.create_task(_keep_frozen(own_nats.pid))
    publishing = asyncio.create_task(
        publish_event(js, TokenEvent(reply_id="r1", seq=1, text="a"), within_s=RETRY_S, bus_is_up=server_answers(client))
    )
    done, _ = await asyncio.wait({publishing}, timeout=4 * RETRY_S)  # frozen far longer than the retry bound
    freezer.cancel()
    assert not done, (
        f"the publisher gave up during a bus outage: {publishing.exception() if done else ''} (server state {_state(own_nats.pid)})"
    )
    os.kill(own_nats.pid, signal.SIGCONT)
    await asyncio.wait_for(publishing, timeout=30)
    assert (await js.stream_info(STREAM)).state.messages == 1
    assert publishes("timeout") > timeouts, "a publish the frozen server never acknowledged counts as a timeout"
    assert (publishes("stored"), publishes_timed()) == (stored + 1, timed + 1), "the publish that got through: stored, timed once"


async def test_an_event_jetstream_does_not_store_while_the_server_answers_makes_the_publisher_give_up(client):
    js = await ensure_token_stream(client)
    await js.delete_stream(STREAM)
    no_stream, timed = publishes("no_stream"), publishes_timed()
    with pytest.raises(CannotPublish):
        await asyncio.wait_for(
            publish_event(js, TokenEvent(reply_id="r1", seq=1, text="a"), within_s=RETRY_S, bus_is_up=server_answers(client)), timeout=30
        )
    assert publishes("no_stream") > no_stream
    assert publishes_timed() == timed, "only stored publishes are timed"
