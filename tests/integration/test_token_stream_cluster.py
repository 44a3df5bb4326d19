"""The token stream on a clustered NATS (tandem up --ha), on real servers: three nats-server
nodes with the stream on all three, made by the admin step (`tandem bus init`). A node killed
with -9 mid-stream, the one the relay and the publisher are connected to and the stream's leader,
costs a pause, never an acknowledged event: every event a publisher got JetStream's
acknowledgement for ends in its reply's token log in Redis, once. And no service role may change
the stream, while `tandem bus init` may, as often as it is run."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from helpers import instance_client, wait_until
from nats.aio.client import Client
from nats.js.errors import APIError

from services.relay.consumer import TokenConsumer, TokenConsumerConfig, consumer_config
from tandem.bus.token_stream import STREAM, TokenStreamConfig, token_stream_config
from tandem.devstack.servers import (
    EmbeddedServer,
    NatsCluster,
    init_token_stream,
    plan_nats_cluster,
    start_nats,
    start_nats_cluster,
    start_nats_node,
)
from tandem.ops import bus_init
from tandem.runtime.runtime import short_command_client
from tandem.tokenlog import TokenLogWriter, logged_events
from tandem.v1.common_pb2 import FINISH_REASON_STOP
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.worker.token_publisher import publish_event, server_answers

NUM_REPLIES = 4
STEP_S = 0.01  # a decode step's cadence: each reply gets one token per step
EVENTS_AFTER_KILL = 150  # per reply: the publishers go on this long past the node's death
KILL_AFTER_LOGGED = 100  # events in the token log before the node dies
MAX_PAUSE_S = 5.0  # the target for a node's loss
# nats-server's raft waits 4 to 9 s (random, not configurable) before the followers elect a new
# leader in place of a dead one, the stream's or the relay's consumer's (each its own raft group);
# measured here 4.6 to 13.7 s with the reconnect and the publisher's backoff, on a busy machine.
MAX_LEADER_LOSS_PAUSE_S = 20.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    nodes = start_nats_cluster(tmp_path)
    init_token_stream(nodes, TokenStreamConfig(num_replicas=3))
    yield nodes
    for node in nodes.nodes:
        if node.child.poll() is None:
            os.kill(node.pid, signal.SIGCONT)
    nodes.stop()


@pytest_asyncio.fixture
async def redis(redis_server: EmbeddedServer) -> AsyncIterator[aioredis.Redis]:
    # The relay's own kind of client: a bounded pool whose commands wait for a free connection.
    client = short_command_client(redis_server.url.removesuffix("/0") + "/5", max_connections=64, login={})
    yield client
    await client.aclose()


async def _connect(urls: list[str]) -> Client:
    """Connected to the first of `urls` (no shuffling), reconnecting to the others as a service does."""
    return await nats.connect(urls, dont_randomize=True, max_reconnect_attempts=-1, reconnect_time_wait=0.1, connect_timeout=2)


@dataclass
class Timeline:
    """When each event was acknowledged to its publisher, and appended by the relay's consumer."""

    acked: dict[str, list[int]] = field(default_factory=dict)
    ack_times: list[float] = field(default_factory=list)
    append_times: list[float] = field(default_factory=list)

    def longest_pause_s(self, times: list[float], since: float) -> float:
        moments = sorted(t for t in times if t >= since)
        return max((b - a for a, b in zip(moments, moments[1:], strict=False)), default=0.0)


async def _publish_reply(js, client: Client, reply_id: str, timeline: Timeline, killed: asyncio.Event) -> None:
    """One reply's events, a step apart, as a worker publishes them (retried until stored), until
    EVENTS_AFTER_KILL past the kill; then its final event."""
    acked = timeline.acked.setdefault(reply_id, [])
    probe = server_answers(client)
    seq, last_seq = 0, None
    while last_seq is None or seq < last_seq:
        seq += 1
        if last_seq is None and killed.is_set():
            last_seq = seq + EVENTS_AFTER_KILL
        is_last = seq == last_seq
        event = TokenEvent(reply_id=reply_id, seq=seq, token_id=seq, text=f"t{seq} ", finish=FINISH_REASON_STOP if is_last else 0)
        await publish_event(js, event, within_s=30, bus_is_up=probe)
        acked.append(seq)
        timeline.ack_times.append(time.monotonic())
        await asyncio.sleep(STEP_S)


async def _stream_leader(client: Client) -> str:
    info = await client.jetstream(timeout=5).stream_info(STREAM)
    assert info.config.num_replicas == 3
    assert info.cluster is not None and info.cluster.leader
    return info.cluster.leader


@pytest.mark.parametrize("is_leader", [False, True], ids=["a-follower", "the-stream-leader"])
async def test_a_killed_node_loses_no_acknowledged_event_and_the_publisher_and_relay_ride_it(cluster, redis, is_leader):
    # The node to kill, which the relay and the publisher both connect to: a follower of the
    # stream's raft group, or its leader (the worst case: the stream answers no one until the
    # others elect a new one).
    probe = await _connect(cluster.url.split(","))
    leader = await _stream_leader(probe)
    await probe.close()
    victim = next(i for i, node in enumerate(cluster.nodes) if (leader == f"tandem-nats-{i}") == is_leader)
    urls = cluster.url.split(",")
    ordered = [urls[victim], *(url for i, url in enumerate(urls) if i != victim)]
    relay_client, publisher = await _connect(ordered), await _connect(ordered)
    assert relay_client.connected_url is not None and relay_client.connected_url.port == int(urls[victim].rsplit(":", 1)[1])

    timeline = Timeline()
    writer = TokenLogWriter(redis, ttl_s=300, running_ttl_s=300)

    async def log_events(events: list[TokenEvent]) -> None:  # a delivery: one event, or a worker's batch
        await writer.append_many(events)
        timeline.append_times.extend(time.monotonic() for _ in events)

    consumer = asyncio.create_task(TokenConsumer(relay_client, log_events, TokenConsumerConfig()).run())
    killed = asyncio.Event()
    reply_ids = [f"chatcmpl-ha-{uuid.uuid4().hex[:8]}-{i}" for i in range(NUM_REPLIES)]
    js = publisher.jetstream()
    publishing = asyncio.gather(*(_publish_reply(js, publisher, reply_id, timeline, killed) for reply_id in reply_ids))
    try:
        await wait_until(lambda: _num_appended(timeline, KILL_AFTER_LOGGED), timeout_s=60)
        consumer_leader = await _consumer_leader(publisher)
        killed_at = time.monotonic()
        os.kill(cluster.nodes[victim].pid, signal.SIGKILL)
        killed.set()
        await asyncio.wait_for(publishing, timeout=120)

        async def all_logged() -> bool:
            for reply_id in reply_ids:
                seqs = [e.seq for e in await logged_events(redis, reply_id)]
                if seqs[-1:] != timeline.acked[reply_id][-1:]:
                    return False
            return True

        await wait_until(all_logged, timeout_s=60)
    finally:
        publishing.cancel()
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await relay_client.close()
        await publisher.close()

    for reply_id in reply_ids:
        logged = [e.seq for e in await logged_events(redis, reply_id)]
        assert len(logged) == len(set(logged)), f"{reply_id}: an event logged twice"
        assert set(timeline.acked[reply_id]) <= set(logged), f"{reply_id}: acknowledged events missing from the log"
        assert logged == list(range(1, len(logged) + 1))
    publish_pause_s = timeline.longest_pause_s(timeline.ack_times, killed_at - 1)
    relay_pause_s = timeline.longest_pause_s(timeline.append_times, killed_at - 1)
    led = [group for group, name in (("stream", leader), ("relay's consumer", consumer_leader)) if name == f"tandem-nats-{victim}"]
    role = f"leader of the {' and the '.join(led)}" if led else "a follower of both"
    print(f"\nkilled nats-{victim} ({role}): longest pause publishing {publish_pause_s:.2f} s, relaying {relay_pause_s:.2f} s")
    bound_s = MAX_LEADER_LOSS_PAUSE_S if led else MAX_PAUSE_S
    assert publish_pause_s <= bound_s and relay_pause_s <= bound_s, (publish_pause_s, relay_pause_s)


async def test_the_relay_pulls_again_as_soon_as_it_is_on_another_node(cluster, redis):
    # The relay's node dies leading neither the stream nor the consumer: no election, so the pause
    # is the relay's own. Heartbeats 20 s apart (loss noticed after 60 s) leave only the reconnect
    # to send the pull again through the node the client is now on.
    probe = await _connect(cluster.url.split(","))
    await probe.jetstream(timeout=10).add_consumer(STREAM, consumer_config(TokenConsumerConfig()))  # to learn its leader
    leaders = {await _stream_leader(probe), await _consumer_leader(probe)}
    victim = next(i for i in range(len(cluster.nodes)) if f"tandem-nats-{i}" not in leaders)
    urls = cluster.url.split(",")
    others = [url for i, url in enumerate(urls) if i != victim]

    async def pull_again() -> None:  # the relay's wiring (services/relay/app.py)
        await consumer.reconnected()

    relay_client = await nats.connect(
        [urls[victim], *others], dont_randomize=True, max_reconnect_attempts=-1, reconnect_time_wait=0.1, reconnected_cb=pull_again
    )
    publisher = await _connect(others)
    logged_up_to = [0]  # the log's last seq: events delivered past a lost one wait for its redelivery
    writer = TokenLogWriter(redis, ttl_s=300, running_ttl_s=300)

    async def log_events(events: list[TokenEvent]) -> None:
        appended = await writer.append_many(events)
        logged_up_to[0] = max(logged_up_to[0], *(a.last_seq for a in appended))

    consumer = TokenConsumer(relay_client, log_events, TokenConsumerConfig(heartbeat_s=20.0, expires_s=60.0))
    consuming = asyncio.create_task(consumer.run())
    reply_id = f"chatcmpl-ha-{uuid.uuid4().hex[:8]}"
    js = publisher.jetstream()

    async def publish() -> None:
        for seq in range(1, 100_000):  # until cancelled
            await publish_event(js, TokenEvent(reply_id=reply_id, seq=seq, text="t"), within_s=30)  # back to back

    publishing = asyncio.create_task(publish())
    try:
        await wait_until(lambda: _at_least(logged_up_to, 50), timeout_s=60)
        os.kill(cluster.nodes[victim].pid, signal.SIGKILL)
        at_kill = logged_up_to[0]
        # A delivery lost with the node comes again after the ack wait (3 s); without the pull sent on reconnecting, 60 s.
        await wait_until(lambda: _at_least(logged_up_to, at_kill + 50), timeout_s=MAX_PAUSE_S + 5)
    finally:
        publishing.cancel()
        consuming.cancel()
        # Bounded: a request nats-py sent during the reconnect may outlast its cancellation; closing ends it.
        await asyncio.wait([publishing, consuming], timeout=5)
        for client in (relay_client, publisher, probe):
            await client.close()
    logged = [event.seq for event in await logged_events(redis, reply_id)]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) >= at_kill + 50, "the log holds each event once, in order"


async def _at_least(last_seq: list[int], seq: int) -> bool:
    return last_seq[0] >= seq


async def _consumer_leader(client: Client) -> str:
    info = await client.jetstream(timeout=5).consumer_info(STREAM, TokenConsumerConfig().durable)
    assert info.cluster is not None
    return info.cluster.leader or ""


async def _num_appended(timeline: Timeline, at_least: int) -> bool:
    return len(timeline.append_times) >= at_least


def _bus_init(url: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'libs'}:{REPO}",
        "TANDEM_NATS_URL": url,
        "TANDEM_NATS_USER": "",
        "TANDEM_NATS_PASSWORD": "",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bus", "init", "--within-s", "20", *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_bus_init_waits_for_a_clusters_last_node_and_names_the_setting_when_too_few_come(tmp_path, caplog):
    """`tandem bus init` run while a node has not yet joined (or reported to the leader: the same
    refusal, "peer offline"): it is refused three replicas and tries again until the node is there;
    asked for more replicas than the cluster's nodes, it stops after the grace, naming the setting."""
    caplog.set_level(logging.INFO, logger=bus_init.__name__)
    plan = plan_nats_cluster(3)
    started = [start_nats_node(tmp_path, node, plan) for node in plan[:2]]
    url = ",".join(node.url for node in started)
    try:
        client = await _connect(url.split(","))
        try:
            await wait_until(lambda: _placement_refused(client, TokenStreamConfig(num_replicas=3)), timeout_s=60)
        finally:
            await client.close()
        initialising = asyncio.create_task(bus_init.init_bus(url, TokenStreamConfig(num_replicas=3), placement_grace_s=120))
        try:
            await wait_until(lambda: _retried(caplog, initialising), timeout_s=30)
            joined_at = time.monotonic()
            started.append(await asyncio.to_thread(start_nats_node, tmp_path, plan[2], plan))
            stream = await asyncio.wait_for(initialising, 120)
        finally:
            initialising.cancel()
        print(f"\nthe stream placed {time.monotonic() - joined_at:.2f} s after the last node started")
        assert stream.num_replicas == 3
        too_many = await asyncio.to_thread(_bus_init, url, "--placement-grace-s", "2", TANDEM_TOKEN_STREAM_REPLICAS="4")
        assert too_many.returncode != 0 and "TANDEM_TOKEN_STREAM_REPLICAS" in too_many.stderr, too_many.stderr
    finally:
        for node in started:
            node.stop()


async def _placement_refused(client: Client, config: TokenStreamConfig) -> bool:
    try:
        await client.jetstream(timeout=2).add_stream(token_stream_config(config))
    except APIError as exc:
        return exc.err_code == bus_init._NO_SUITABLE_PEERS
    except nats.errors.TimeoutError:  # no leader yet
        return False
    raise AssertionError("two nodes of three placed three replicas")


async def _retried(caplog: pytest.LogCaptureFixture, initialising: asyncio.Task) -> bool:
    if initialising.done():
        initialising.result()  # its error, if it gave up
        raise AssertionError("bus init placed three replicas on two nodes")
    return any(record.name == bus_init.__name__ for record in caplog.records)


@pytest.fixture
def bare_nats(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A server with no token stream yet: what `tandem bus init` starts from."""
    server = start_nats(tmp_path)
    yield server
    server.stop()


async def test_bus_init_creates_the_stream_and_running_it_again_changes_nothing(bare_nats):
    first = _bus_init(bare_nats.url, TANDEM_TOKEN_STREAM_MAX_BYTES=str(64 << 20))
    assert first.returncode == 0, first.stderr
    client = await nats.connect(bare_nats.url)
    try:
        js = client.jetstream()
        await js.publish("tandem.v1.tokens.chatcmpl-init", b"an event a relay has not taken yet", stream=STREAM)
        before = await js.stream_info(STREAM)
        second = _bus_init(bare_nats.url, TANDEM_TOKEN_STREAM_MAX_BYTES=str(64 << 20))
        assert second.returncode == 0, second.stderr
        after = await js.stream_info(STREAM)
    finally:
        await client.close()
    assert second.stdout == first.stdout and "discard new" in first.stdout
    assert after.config == before.config and after.config.max_bytes == 64 << 20
    assert after.state.messages == before.state.messages == 1  # an update keeps what the stream holds
    too_many = _bus_init(bare_nats.url, TANDEM_TOKEN_STREAM_REPLICAS="3")
    assert too_many.returncode != 0 and "TANDEM_TOKEN_STREAM_REPLICAS" in too_many.stderr


@pytest.mark.parametrize("role", ["relay", "decode", "router"])
async def test_a_service_instance_is_refused_changing_or_deleting_the_token_stream(nats_server, role):
    instance_id = f"{role}-admin-{uuid.uuid4().hex[:8]}"
    refusals: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        refusals.append(exc)

    client = await instance_client(nats_server.url, role, instance_id, on_error)  # its own instance's login and inbox
    try:
        js = client.jetstream(timeout=1)
        before = (await js.stream_info(STREAM)).config  # looking it up is allowed: services wait for it
        changed = token_stream_config(TokenStreamConfig(max_bytes=before.max_bytes // 2))
        with pytest.raises(nats.errors.TimeoutError):  # the server drops the request and says why
            await js.update_stream(changed)
        with pytest.raises(nats.errors.TimeoutError):
            await js.delete_stream(STREAM)
        after = (await js.stream_info(STREAM)).config
    finally:
        await client.close()
    assert after == before
    # nats-py reports a refused publish as its base error type (tandem.bus.connection): one per try.
    assert [type(exc) for exc in refusals] == [nats.errors.Error, nats.errors.Error], refusals
