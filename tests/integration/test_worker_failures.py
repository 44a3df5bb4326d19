"""Workers under failure, as real processes on a real nats-server of this module's own (JetStream
on; one test deletes the token stream):

- a continuation (tokens already generated, numbering going on, a new owner epoch) streams the
  uninterrupted run's tokens with the new epoch, through a decode worker's local prefill and
  through a prefill -> decode handoff alike; its events are stored on JetStream; the worker's
  heartbeat claims the reply until its final event; a newer epoch of a reply still running here
  stops the old run first;
- an out-of-vocabulary token id is refused and the worker goes on serving;
- an engine that dies, or token events that cannot be published, make the worker say it is not
  ready, claim nothing and exit 1;
- SIGTERM drains: a running reply finishes and the worker exits 0; with a short drain timeout it
  exits 0 and gives the reply up (its last heartbeat no longer claims it)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
import pytest_asyncio
import torch
from helpers import children_of, service_env, service_process
from nats.aio.client import Client

from tandem.bus import decode, encode, subjects
from tandem.bus.token_batches import events_in, watch_events
from tandem.bus.token_stream import STREAM, ensure_token_stream
from tandem.devstack.proc import ChildProcess, free_port
from tandem.devstack.servers import EmbeddedServer, init_token_stream, start_nats
from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.models.loader import LoadedModel, load_model
from tandem.v1 import common_pb2
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.kv_handoff_pb2 import KvLayout, ReserveRequest
from tandem.v1.kv_handoff_pb2_grpc import KvHandoffStub
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.v1.worker_pb2 import WorkerHeartbeat
from tandem.worker.internal_grpc import internal_channel

pytestmark = pytest.mark.real_model

SECRET = "worker-failures-test-secret"  # the workers' internal secret: every gRPC call carries it
STORY = [{"role": "user", "content": "Tell me a very long story about a dragon who learns to bake bread."}]


@pytest.fixture(scope="module")
def own_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    server = start_nats(Path(tmp_path_factory.mktemp("worker-failures-nats")))
    init_token_stream(server)  # the admin step: workers only wait for the stream
    yield server
    server.stop()


@pytest_asyncio.fixture
async def bus(own_nats: EmbeddedServer) -> AsyncIterator[Client]:
    client = await nats.connect(own_nats.url)
    await ensure_token_stream(client)
    yield client
    await client.close()


@pytest.fixture(scope="module")
def smollm2_fp32() -> LoadedModel:
    return load_model(None, torch.float32, "cpu", select_attention("cpu"))


def _worker(role: str, own_nats: EmbeddedServer, redis_url: str, **extra: str) -> tuple[ChildProcess, str]:
    settings = {"TANDEM_DTYPE": "fp32", "TANDEM_KV_CACHE_MIB": "64", "TANDEM_UCX_PORT": str(free_port()), **extra}
    settings["TANDEM_INTERNAL_SECRET"] = SECRET
    env = service_env(role, own_nats.url, redis_url, **settings)
    return service_process(role, env), env["TANDEM_INSTANCE_ID"]


@pytest.fixture(scope="module")
def decode_worker(own_nats, redis_server) -> Iterator[str]:
    child, instance_id = _worker("decode", own_nats, redis_server.url)
    child.start()
    yield instance_id
    child.stop(timeout_s=10)


@pytest.fixture(scope="module")
def prefill_worker(own_nats, redis_server) -> Iterator[str]:
    child, instance_id = _worker("prefill", own_nats, redis_server.url)
    child.start()
    yield instance_id
    child.stop(timeout_s=10)


@dataclass
class Heartbeats:
    """Every heartbeat of one worker from now on."""

    seen: list[WorkerHeartbeat] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_for(self, accept: Callable[[WorkerHeartbeat], bool], timeout_s: float = 120) -> WorkerHeartbeat:
        """The first heartbeat seen from now on that `accept` likes."""
        start = len(self.seen)

        async def first() -> WorkerHeartbeat:
            index = start
            while True:
                while index < len(self.seen):
                    if accept(self.seen[index]):
                        return self.seen[index]
                    index += 1
                self.changed.clear()
                await self.changed.wait()

        return await asyncio.wait_for(first(), timeout_s)


async def _heartbeats(nc: Client, role: str, instance_id: str) -> Heartbeats:
    heartbeats = Heartbeats()

    async def on_heartbeat(msg) -> None:
        heartbeats.seen.append(decode(msg.data, WorkerHeartbeat))
        heartbeats.changed.set()

    await nc.subscribe(subjects.heartbeat(role, instance_id), cb=on_heartbeat)
    await nc.flush()
    return heartbeats


@dataclass
class Stream:
    events: list[TokenEvent] = field(default_factory=list)
    first: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


async def _stream(nc: Client, reply_id: str) -> Stream:
    stream = Stream()

    async def on_event(event: TokenEvent) -> None:
        stream.events.append(event)
        stream.first.set()
        if event.finish != common_pb2.FINISH_REASON_UNSPECIFIED:
            stream.done.set()

    await watch_events(nc, on_event, reply_id)
    await nc.flush()
    return stream


def _request(prompt_ids: list[int], max_tokens: int, generated: list[int] = ()) -> GenerateRequest:
    request = GenerateRequest(
        model="auto", prompt_token_ids=prompt_ids, lane=common_pb2.LANE_PAID, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
    )
    request.generated_token_ids.extend(generated)
    return request


async def _assign(nc: Client, instance_id: str, assignment: Assignment) -> AssignmentReply:
    msg = await nc.request(subjects.assign(instance_id), encode(assignment), timeout=30)
    return decode(msg.data, AssignmentReply)


def _expected(model: LoadedModel, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    stream = Engine(model, EngineConfig(kv_cache_mib=64)).generate([Request("x", tuple(prompt), SamplingOptions(max_tokens=max_tokens))])[
        "x"
    ]
    return [t for o in stream for t in o.new_token_ids], "".join(o.text for o in stream)


async def _stored_on_jetstream(nc: Client, reply_id: str) -> list[TokenEvent]:
    """The reply's events as the token stream stored them (in its worker's batches)."""
    js = nc.jetstream()
    subscription = await js.pull_subscribe(subjects.TOKEN_BATCHES_ALL, stream=STREAM)
    stored: list[TokenEvent] = []
    try:
        while True:
            try:
                messages = await subscription.fetch(100, timeout=1)
            except TimeoutError:  # nothing more stored (nats' own TimeoutError is one too)
                return stored
            for message in messages:
                stored.extend(event for event in events_in(message) if event.reply_id == reply_id)
                await message.ack()
    finally:
        await subscription.unsubscribe()


async def test_a_continuation_streams_on_with_its_epoch_is_stored_on_jetstream_and_claimed_until_its_end(decode_worker, bus, smollm2_fp32):
    heartbeats = await _heartbeats(bus, "decode", decode_worker)
    await heartbeats.wait_for(lambda hb: hb.service.is_ready)
    prompt = smollm2_fp32.tokenizer.encode_chat(STORY)
    expected, expected_text = _expected(smollm2_fp32, prompt, 48)
    stream = await _stream(bus, "reply-epoch")
    continued = Assignment(reply_id="reply-epoch", request=_request(prompt, 48, expected[:3]), first_seq=4, epoch=3)
    assert (await _assign(bus, decode_worker, continued)).WhichOneof("outcome") == "accepted"
    await heartbeats.wait_for(lambda hb: "reply-epoch" in hb.reply_ids, timeout_s=60)
    await asyncio.wait_for(stream.done.wait(), 120)

    events = stream.events
    assert [e.seq for e in events] == list(range(4, 4 + len(events)))
    assert {e.epoch for e in events} == {3}
    assert [e.token_id for e in events] == expected[3:]
    assert "".join(e.text for e in events) == expected_text[len(smollm2_fp32.tokenizer.decode(expected[:3])) :]
    assert events[-1].usage.output_tokens == len(expected)
    await heartbeats.wait_for(lambda hb: "reply-epoch" not in hb.reply_ids)
    stored = await _stored_on_jetstream(bus, "reply-epoch")
    assert [(e.seq, e.epoch, e.token_id) for e in stored] == [(e.seq, e.epoch, e.token_id) for e in events]


async def test_a_continuation_handed_from_a_prefill_worker_keeps_its_epoch_and_numbering(decode_worker, prefill_worker, bus, smollm2_fp32):
    decode_beats = await _heartbeats(bus, "decode", decode_worker)
    prefill_beats = await _heartbeats(bus, "prefill", prefill_worker)
    decode_ready = await decode_beats.wait_for(lambda hb: hb.service.is_ready)
    await prefill_beats.wait_for(lambda hb: hb.service.is_ready)
    prompt = smollm2_fp32.tokenizer.encode_chat([{"role": "user", "content": "List the planets of the solar system, one per line."}])
    expected, expected_text = _expected(smollm2_fp32, prompt, 24)
    stream = await _stream(bus, "reply-handed")
    continued = Assignment(
        reply_id="reply-handed",
        request=_request(prompt, 24, expected[:5]),
        first_seq=6,
        epoch=2,
        decode_worker_id=decode_worker,
        decode_grpc_address=decode_ready.grpc_address,
    )
    assert (await _assign(bus, prefill_worker, continued)).WhichOneof("outcome") == "accepted"
    await asyncio.wait_for(stream.done.wait(), 120)
    events = stream.events
    assert [e.seq for e in events] == list(range(6, 6 + len(events)))
    assert {e.epoch for e in events} == {2}
    assert events[0].worker_id == prefill_worker and events[-1].worker_id == decode_worker, "the reply was handed over"
    assert [e.token_id for e in events] == expected[5:]
    assert "".join(e.text for e in events) == expected_text[len(smollm2_fp32.tokenizer.decode(expected[:5])) :]
    await prefill_beats.wait_for(lambda hb: "reply-handed" not in hb.reply_ids)
    await decode_beats.wait_for(lambda hb: "reply-handed" not in hb.reply_ids)


async def test_an_out_of_vocabulary_token_id_is_refused_and_the_worker_serves_on(decode_worker, bus, smollm2_fp32):
    heartbeats = await _heartbeats(bus, "decode", decode_worker)
    ready = await heartbeats.wait_for(lambda hb: hb.service.is_ready)
    vocab_size = smollm2_fp32.config.vocab_size
    for reply_id, request in (
        ("reply-oov-prompt", _request([1, 2, vocab_size], 4)),
        ("reply-oov-generated", _request([1, 2, 3], 4, [vocab_size + 7])),
    ):
        refused = await _assign(bus, decode_worker, Assignment(reply_id=reply_id, request=request, first_seq=1))
        assert refused.refused.reason == "bad_request", refused
    layout = KvLayout(
        model=ready.model, dtype="float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64, byte_order=sys.byteorder
    )
    async with internal_channel(ready.grpc_address, SECRET) as channel:
        reserve = ReserveRequest(reply_id="reply-oov-handoff", layout=layout, num_blocks=1, request=_request([1, vocab_size + 1], 4))
        reserved = await KvHandoffStub(channel).Reserve(reserve, timeout=10)
    assert reserved.refused.reason == "bad_request", reserved

    stream = await _stream(bus, "reply-after-oov")
    assert (await _assign(bus, decode_worker, Assignment(reply_id="reply-after-oov", request=_request([1, 2, 3], 3), first_seq=1))).accepted
    await asyncio.wait_for(stream.done.wait(), 60)
    assert [e.seq for e in stream.events] == list(range(1, len(stream.events) + 1))
    assert stream.events[-1].finish in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert (await heartbeats.wait_for(lambda hb: True)).service.is_ready


async def test_a_newer_epoch_of_a_reply_running_here_stops_the_old_run_and_a_retry_of_the_same_epoch_is_not_run_twice(
    decode_worker, bus, smollm2_fp32
):
    """The relay continued a reply it thought stalled, and the router picked this worker again:
    the old run (whose events the log now drops) stops, and the new owner starts once it has."""
    heartbeats = await _heartbeats(bus, "decode", decode_worker)
    await heartbeats.wait_for(lambda hb: hb.service.is_ready)
    request = _request(smollm2_fp32.tokenizer.encode_chat(STORY), 2000)
    stream = await _stream(bus, "reply-moved")
    assert (await _assign(bus, decode_worker, Assignment(reply_id="reply-moved", request=request, first_seq=1))).accepted
    await asyncio.wait_for(stream.first.wait(), 60)
    retried = await _assign(bus, decode_worker, Assignment(reply_id="reply-moved", request=request, first_seq=1))
    assert retried.accepted, "a retried assignment of the running epoch is the same run"
    newer = await _assign(bus, decode_worker, Assignment(reply_id="reply-moved", request=request, first_seq=1, epoch=1))
    assert newer.refused.reason == "superseded", newer
    await asyncio.wait_for(stream.done.wait(), 60)
    old_run = list(stream.events)
    assert {e.epoch for e in old_run} == {0} and old_run[-1].finish == common_pb2.FINISH_REASON_CANCELLED
    assert [e.seq for e in old_run] == list(range(1, len(old_run) + 1)), "one run, not two"
    await heartbeats.wait_for(lambda hb: "reply-moved" not in hb.reply_ids)

    stream.done.clear()
    request.sampling.max_tokens = 3
    assert (await _assign(bus, decode_worker, Assignment(reply_id="reply-moved", request=request, first_seq=1, epoch=1))).accepted
    await asyncio.wait_for(stream.done.wait(), 60)
    new_run = stream.events[len(old_run) :]
    assert {e.epoch for e in new_run} == {1} and [e.seq for e in new_run] == list(range(1, len(new_run) + 1))


async def test_an_engine_that_dies_makes_the_worker_say_so_and_exit_1(own_nats, redis_server, bus):
    # 4 TiB of KV cache: the engine thread dies allocating it, after the model loaded.
    child, instance_id = _worker("decode", own_nats, redis_server.url, TANDEM_KV_CACHE_MIB=str(4 * 2**20))
    heartbeats = await _heartbeats(bus, "decode", instance_id)
    child.start()
    try:
        code = await asyncio.wait_for(child.wait_async(), 120)
    finally:
        child.stop(timeout_s=5)
    assert code == 1, child.recent_output()
    assert heartbeats.seen, "it heartbeat before it exited"
    assert not any(hb.service.is_ready or hb.is_engine_ready for hb in heartbeats.seen)
    assert heartbeats.seen[-1].service.is_draining, "its last heartbeat says it is going"


async def test_a_worker_with_its_engine_on_a_thread_serves_a_reply_to_its_end(own_nats, redis_server, bus):
    # TANDEM_ENGINE_PROCESS=false: the GPU's way, on this CPU: no engine process, the same replies.
    child, instance_id = _worker("decode", own_nats, redis_server.url, TANDEM_ENGINE_PROCESS="false")
    heartbeats = await _heartbeats(bus, "decode", instance_id)
    child.start()
    try:
        await heartbeats.wait_for(lambda hb: hb.service.is_ready)
        stream = await _stream(bus, "reply-on-a-thread")
        assignment = Assignment(reply_id="reply-on-a-thread", request=_request([1, 2, 3, 4], 6), first_seq=1)
        assert (await _assign(bus, instance_id, assignment)).accepted
        await asyncio.wait_for(stream.done.wait(), 60)
        engines = children_of(child.pid)
    finally:
        child.stop(timeout_s=5)
    assert not engines, "the engine ran on a thread of the worker"
    assert [e.seq for e in stream.events] == list(range(1, len(stream.events) + 1)) and len(stream.events) == 6


async def test_an_engine_process_killed_mid_reply_makes_the_worker_give_up_its_replies_and_exit_1(own_nats, redis_server, bus):
    child, instance_id = _worker("decode", own_nats, redis_server.url)
    heartbeats = await _heartbeats(bus, "decode", instance_id)
    child.start()
    try:
        await heartbeats.wait_for(lambda hb: hb.service.is_ready)
        stream = await _stream(bus, "reply-engine-killed")
        assignment = Assignment(reply_id="reply-engine-killed", request=_request([1, 2, 3, 4], 2000), first_seq=1)
        assert (await _assign(bus, instance_id, assignment)).accepted
        await asyncio.wait_for(stream.first.wait(), 60)
        engines = children_of(child.pid)
        assert len(engines) == 1, f"one engine process under the worker, not {engines}"
        os.kill(engines[0], signal.SIGKILL)
        not_ready = await heartbeats.wait_for(lambda hb: not hb.service.is_ready, timeout_s=60)
        code = await asyncio.wait_for(child.wait_async(), 60)
    finally:
        child.stop(timeout_s=5)
    assert code == 1, child.recent_output()
    assert not not_ready.reply_ids and not not_ready.is_engine_ready, "it gives the reply up for another worker to continue"
    assert not stream.done.is_set(), "no final event: the relay continues the reply elsewhere"


async def test_token_events_that_cannot_be_published_make_the_worker_give_up_its_replies_and_exit_1(own_nats, redis_server, bus):
    child, instance_id = _worker("decode", own_nats, redis_server.url)
    heartbeats = await _heartbeats(bus, "decode", instance_id)
    child.start()
    try:
        await heartbeats.wait_for(lambda hb: hb.service.is_ready)
        await bus.jetstream().delete_stream(STREAM)  # nothing stores token events any more
        try:
            assignment = Assignment(reply_id="reply-unpublishable", request=_request([1, 2, 3, 4], 40), first_seq=1)
            assert (await _assign(bus, instance_id, assignment)).accepted
            await heartbeats.wait_for(lambda hb: "reply-unpublishable" in hb.reply_ids, timeout_s=30)
            not_ready = await heartbeats.wait_for(lambda hb: not hb.service.is_ready, timeout_s=60)
            code = await asyncio.wait_for(child.wait_async(), 60)
        finally:
            await ensure_token_stream(bus)
    finally:
        child.stop(timeout_s=5)
    assert code == 1, child.recent_output()
    assert not not_ready.reply_ids and not not_ready.is_engine_ready
    assert "reply-unpublishable" not in heartbeats.seen[-1].reply_ids


async def _long_reply_then_sigterm(
    bus: Client, own_nats: EmbeddedServer, redis_url: str, prompt: list[int], reply_id: str, drain_timeout_s: str
) -> tuple[int, Stream, Heartbeats]:
    child, instance_id = _worker("decode", own_nats, redis_url, TANDEM_DRAIN_TIMEOUT_S=drain_timeout_s)
    heartbeats = await _heartbeats(bus, "decode", instance_id)
    child.start()
    try:
        await heartbeats.wait_for(lambda hb: hb.service.is_ready)
        stream = await _stream(bus, reply_id)
        # A story of up to 2000 tokens (given up) or 60 tokens (finished).
        max_tokens = 60 if float(drain_timeout_s) > 10 else 2000
        assert (await _assign(bus, instance_id, Assignment(reply_id=reply_id, request=_request(prompt, max_tokens), first_seq=1))).accepted
        await asyncio.wait_for(stream.first.wait(), 60)
        child.process.send_signal(signal.SIGTERM)
        draining = await heartbeats.wait_for(lambda hb: hb.service.is_draining, timeout_s=30)
        assert reply_id in draining.reply_ids, "the reply was still running when the drain began"
        refused = await _assign(bus, instance_id, Assignment(reply_id=f"{reply_id}-late", request=_request([1, 2, 3], 4), first_seq=1))
        assert refused.refused.reason == "draining"
        code = await asyncio.wait_for(child.wait_async(), 120)
    finally:
        child.stop(timeout_s=5)
    return code, stream, heartbeats


async def test_sigterm_lets_a_running_reply_finish_then_exits_0(own_nats, redis_server, bus, smollm2_fp32):
    prompt = smollm2_fp32.tokenizer.encode_chat(STORY)
    code, stream, heartbeats = await _long_reply_then_sigterm(bus, own_nats, redis_server.url, prompt, "reply-drained", "60")
    assert code == 0
    assert stream.done.is_set(), "the reply ended with its final event"
    assert stream.events[-1].finish in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert [e.seq for e in stream.events] == list(range(1, len(stream.events) + 1))
    assert "reply-drained" not in heartbeats.seen[-1].reply_ids


async def test_a_drain_that_times_out_gives_the_reply_up_unclaimed_and_exits_0(own_nats, redis_server, bus, smollm2_fp32):
    prompt = smollm2_fp32.tokenizer.encode_chat(STORY)
    code, stream, heartbeats = await _long_reply_then_sigterm(bus, own_nats, redis_server.url, prompt, "reply-given-up", "1")
    assert code == 0
    assert not stream.done.is_set(), "a 2000-token story outlasts a 1 s drain: no final event"
    last = heartbeats.seen[-1]
    assert last.service.is_draining and "reply-given-up" not in last.reply_ids, "its last heartbeat gives the reply up"
