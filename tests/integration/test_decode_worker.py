"""The decode worker as a real process on real NATS: an Assignment becomes a TokenEvent stream
equal to the in-process engine's output, a cancel stops it and frees every block, and its prefix
cache's changes go out as KV events (contiguous ids, the engine's block keys) with the full
state on request."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from helpers import next_heartbeat, ops_url, service_env, service_process, wait_until

from tandem.bus import decode, encode, subjects
from tandem.bus.events import now_ms
from tandem.bus.token_batches import watch_events
from tandem.devstack.proc import ChildProcess
from tandem.engine.block_hash import prefix_block_hashes
from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.models.loader import LoadedModel, load_model
from tandem.v1 import common_pb2
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.kv_handoff_pb2 import KvLayout, ReleaseRequest, RenewRequest, ReserveRequest
from tandem.v1.kv_handoff_pb2_grpc import KvHandoffStub
from tandem.v1.kv_pb2 import KvEvent, KvState, KvStateRequest
from tandem.v1.tokens_pb2 import Cancel, TokenEvent
from tandem.worker.internal_grpc import internal_channel

pytestmark = pytest.mark.real_model

SECRET = "decode-worker-test-secret"  # every gRPC call carries it


@pytest.fixture(scope="module")
def smollm2_fp32() -> LoadedModel:
    return load_model(None, torch.float32, "cpu", select_attention("cpu"))


@pytest.fixture(scope="module")
def decode_env(nats_server, redis_server) -> dict[str, str]:
    return service_env(
        "decode", nats_server.url, redis_server.url, TANDEM_DTYPE="fp32", TANDEM_KV_CACHE_MIB="64", TANDEM_INTERNAL_SECRET=SECRET
    )


@pytest.fixture(scope="module")
def decode_worker(decode_env) -> Iterator[tuple[ChildProcess, str]]:
    env = decode_env
    child = service_process("decode", env)
    child.start()
    yield child, env["TANDEM_INSTANCE_ID"]
    child.stop(timeout_s=10)


async def _ready(nc, instance_id: str):
    return await next_heartbeat(nc, "decode", instance_id, accept=lambda hb: hb.is_ready, timeout_s=120)


def _request(prompt_ids: list[int], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        model="auto",
        prompt_token_ids=prompt_ids,
        lane=common_pb2.LANE_PAID,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )


async def _assign(nc, instance_id: str, reply_id: str, request: GenerateRequest) -> AssignmentReply:
    msg = await nc.request(subjects.assign(instance_id), encode(Assignment(reply_id=reply_id, request=request, first_seq=1)), timeout=30)
    return decode(msg.data, AssignmentReply)


async def _collect(nc, reply_id: str) -> tuple[asyncio.Future[list[TokenEvent]], object, asyncio.Event]:
    events: list[TokenEvent] = []
    done = asyncio.get_running_loop().create_future()
    first = asyncio.Event()

    async def on_event(event: TokenEvent) -> None:
        events.append(event)
        first.set()
        if event.finish != common_pb2.FINISH_REASON_UNSPECIFIED and not done.done():
            done.set_result(events)

    subscription = await watch_events(nc, on_event, reply_id)
    return done, subscription, first


async def test_an_assignment_streams_the_engines_tokens(decode_worker, nc, smollm2_fp32):
    _, instance_id = decode_worker
    heartbeat = await _ready(nc, instance_id)
    engine = Engine(smollm2_fp32, EngineConfig(kv_cache_mib=64))
    # 64 MiB of fp32 KV holds less than SmolLM2's 8192-token window: the worker serves what it holds.
    assert heartbeat.is_engine_ready and heartbeat.max_model_len == engine.kv_plan.max_model_len < 8192
    prompt = smollm2_fp32.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    expected = engine.generate([Request("x", tuple(prompt), SamplingOptions(max_tokens=24))])["x"]

    done, subscription, _ = await _collect(nc, "reply-paris")
    reply = await _assign(nc, instance_id, "reply-paris", _request(prompt, 24))
    assert reply.WhichOneof("outcome") == "accepted"
    events = await asyncio.wait_for(done, 120)
    await subscription.unsubscribe()

    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.token_id for e in events] == [t for o in expected for t in o.new_token_ids]
    assert "".join(e.text for e in events) == "".join(o.text for o in expected)
    assert "Paris" in "".join(e.text for e in events)
    last = events[-1]
    assert last.finish == common_pb2.FINISH_REASON_STOP
    assert (last.usage.input_tokens, last.usage.output_tokens) == (len(prompt), len(events))


async def test_cancel_stops_the_reply_and_frees_its_blocks(decode_worker, nc, smollm2_fp32):
    _, instance_id = decode_worker
    idle = await _ready(nc, instance_id)
    prompt = smollm2_fp32.tokenizer.encode_chat([{"role": "user", "content": "Tell me a very long story about a dragon."}])
    done, subscription, first = await _collect(nc, "reply-long")
    assert (await _assign(nc, instance_id, "reply-long", _request(prompt, 2000))).WhichOneof("outcome") == "accepted"
    await asyncio.wait_for(first.wait(), 120)
    await nc.publish(subjects.cancel("reply-long"), b"")
    events = await asyncio.wait_for(done, 60)
    await subscription.unsubscribe()
    assert events[-1].finish == common_pb2.FINISH_REASON_CANCELLED
    assert len(events) < 2000
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    # The engine records its stats before handing a step's outputs over, so a heartbeat sent
    # after the final event counts the freed blocks; skip one that may have been in flight.
    await next_heartbeat(nc, "decode", instance_id, timeout_s=30)
    freed = await next_heartbeat(nc, "decode", instance_id, timeout_s=30)
    assert freed.kv_blocks_free == idle.kv_blocks_free == freed.kv_blocks_total


def dropped_cancels(metrics_text: str, reason: str) -> float:
    match = re.search(rf'^tandem_bus_messages_dropped_total\{{kind="cancel",reason="{reason}"\}} (\S+)$', metrics_text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_a_cancel_that_fails_validation_is_dropped_counted_and_stops_nothing(decode_worker, decode_env, nc, smollm2_fp32):
    _, instance_id = decode_worker
    await _ready(nc, instance_id)
    prompt = smollm2_fp32.tokenizer.encode_chat([{"role": "user", "content": "Tell me a very long story about a knight."}])
    num_seen = 0

    async def count(event: TokenEvent) -> None:
        nonlocal num_seen
        num_seen += 1

    counting = await watch_events(nc, count, "reply-spared")
    done, subscription, first = await _collect(nc, "reply-spared")
    assert (await _assign(nc, instance_id, "reply-spared", _request(prompt, 2000))).WhichOneof("outcome") == "accepted"
    await asyncio.wait_for(first.wait(), 120)
    # Both name reply-spared's subject: one's payload speaks for another reply, one is garbage.
    await nc.publish(subjects.cancel("reply-spared"), encode(Cancel(reply_id="reply-other", reason="user")))
    await nc.publish(subjects.cancel("reply-spared"), b"\xff\xff\xff")
    await nc.flush()
    async with httpx.AsyncClient(base_url=ops_url(decode_env), timeout=10) as http:

        async def both_counted() -> str:
            text = (await http.get("/metrics")).text
            return text if dropped_cancels(text, "id_mismatch") >= 1 and dropped_cancels(text, "undecodable") >= 1 else ""

        await wait_until(both_counted, timeout_s=30)
    num_at_drop = num_seen
    await wait_until(lambda: _now(num_seen >= num_at_drop + 5), timeout_s=60)  # it goes on after both were dropped
    assert not done.done(), "a dropped cancel stops nothing"
    await nc.publish(subjects.cancel("reply-spared"), encode(Cancel(reply_id="reply-spared", reason="user")))
    events = await asyncio.wait_for(done, 60)
    await subscription.unsubscribe()
    await counting.unsubscribe()
    assert events[-1].finish == common_pb2.FINISH_REASON_CANCELLED and len(events) < 2000


async def _now(value: bool) -> bool:
    return value


async def test_bad_assignments_are_refused_with_a_reason(decode_worker, nc):
    _, instance_id = decode_worker
    await _ready(nc, instance_id)
    empty = await _assign(nc, instance_id, "reply-empty", _request([], 10))
    assert empty.refused.reason == "bad_request" and "empty" in empty.refused.message
    bad_sampling = _request([1, 2, 3], 10)
    bad_sampling.sampling.temperature = -1
    refused = await _assign(nc, instance_id, "reply-bad", bad_sampling)
    assert refused.refused.reason == "bad_request" and "temperature" in refused.refused.message
    garbage = await nc.request(subjects.assign(instance_id), b"\xff\xff\xff", timeout=30)
    assert decode(garbage.data, AssignmentReply).refused.reason == "bad_request"


async def test_an_assignment_past_its_accept_by_deadline_is_refused_and_never_runs(decode_worker, nc):
    _, instance_id = decode_worker
    await _ready(nc, instance_id)
    done, subscription, first = await _collect(nc, "reply-late")
    late = Assignment(reply_id="reply-late", request=_request([1, 2, 3, 4], 4), first_seq=1, accept_by_unix_ms=now_ms() - 1)
    reply = decode((await nc.request(subjects.assign(instance_id), encode(late), timeout=30)).data, AssignmentReply)
    assert reply.refused.reason == "expired"
    # A later reply's whole stream is a barrier: the late one would have streamed by then.
    barrier, barrier_subscription, _ = await _collect(nc, "reply-after-late")
    assert (await _assign(nc, instance_id, "reply-after-late", _request([1, 2, 3, 4], 2))).WhichOneof("outcome") == "accepted"
    await asyncio.wait_for(barrier, 60)
    await barrier_subscription.unsubscribe()
    await subscription.unsubscribe()
    assert not first.is_set() and not done.done()


async def test_a_continuation_streams_after_the_tokens_it_was_given_and_counts_them(decode_worker, nc, smollm2_fp32):
    """What the router sends after a failed handoff: the prompt, the tokens already published as
    generated tokens, and the numbering continuing after them."""
    _, instance_id = decode_worker
    await _ready(nc, instance_id)
    prompt = smollm2_fp32.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers of Europe."}])
    expected_stream = Engine(smollm2_fp32, EngineConfig(kv_cache_mib=64)).generate(
        [Request("x", tuple(prompt), SamplingOptions(max_tokens=12))]
    )["x"]
    expected = [t for o in expected_stream for t in o.new_token_ids]
    request = _request(prompt, 12)
    request.generated_token_ids.extend(expected[:3])
    done, subscription, _ = await _collect(nc, "reply-continued")
    continued = Assignment(reply_id="reply-continued", request=request, first_seq=4)
    reply = decode((await nc.request(subjects.assign(instance_id), encode(continued), timeout=30)).data, AssignmentReply)
    assert reply.WhichOneof("outcome") == "accepted"
    events = await asyncio.wait_for(done, 120)
    await subscription.unsubscribe()
    assert [e.seq for e in events] == list(range(4, 4 + len(events)))
    assert [e.token_id for e in events] == expected[3:]
    assert "".join(e.text for e in events) == "".join(o.text for o in expected_stream)[len(smollm2_fp32.tokenizer.decode(expected[:3])) :]
    assert (events[-1].usage.input_tokens, events[-1].usage.output_tokens) == (len(prompt), len(expected))


async def _idle_kv_event_id(nc, instance_id: str) -> int:
    """The worker's last published KV event id once it is idle: two heartbeats in a row agree."""
    previous = (await next_heartbeat(nc, "decode", instance_id, timeout_s=30)).kv_event_id
    while True:
        current = (await next_heartbeat(nc, "decode", instance_id, timeout_s=30)).kv_event_id
        if current == previous:
            return current
        previous = current


async def test_kv_events_carry_the_prompts_block_keys_with_contiguous_ids_and_the_state_agrees(decode_worker, nc, smollm2_fp32):
    _, instance_id = decode_worker
    await _ready(nc, instance_id)
    events: list[KvEvent] = []

    async def on_kv_event(msg):
        events.append(decode(msg.data, KvEvent))

    kv_subscription = await nc.subscribe(subjects.kv_events(instance_id), cb=on_kv_event)
    await nc.flush()
    # Every event after this heartbeat's id is published after it, so it reaches us.
    before = await _idle_kv_event_id(nc, instance_id)

    tenant = "kv-events-test"  # a namespace no other test's blocks share
    prompt = smollm2_fp32.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers of Europe and one of Asia."}])
    request = _request(prompt, 20)
    request.tenant = tenant
    done, token_subscription, _ = await _collect(nc, "reply-kv")
    assert (await _assign(nc, instance_id, "reply-kv", request)).WhichOneof("outcome") == "accepted"
    tokens = await asyncio.wait_for(done, 120)
    await token_subscription.unsubscribe()
    last = await _idle_kv_event_id(nc, instance_id)
    await kv_subscription.unsubscribe()

    mine = [e for e in events if e.event_id > before]
    assert [e.event_id for e in mine] == list(range(before + 1, last + 1)), "one id per message, none skipped"
    assert {e.worker_id for e in mine} == {instance_id}
    stored = [b for e in mine if e.WhichOneof("change") == "stored" for b in e.stored.blocks]
    # Every full block of the computed tokens (the prompt, and the reply but its last token).
    computed = [*prompt, *(e.token_id for e in tokens[:-1])]
    expected = prefix_block_hashes(computed, tenant=tenant, num_public_prefix_tokens=0, block_size=16)
    assert len(prompt) >= 32 and len(expected) >= 2
    assert [b.block_hash for b in stored if b.block_hash in set(expected)] == expected
    assert [b.parent_hash for b in stored if b.block_hash in set(expected)] == [0, *expected[:-1]]
    assert {b.num_tokens for b in stored} == {16}

    reply = await nc.request(subjects.kv_state(instance_id), encode(KvStateRequest()), timeout=30)
    state = decode(reply.data, KvState)
    assert (state.worker_id, state.event_id) == (instance_id, last)
    parents = {b.block_hash: b.parent_hash for b in state.blocks}
    assert all(parents.get(h) == p for h, p in zip(expected, [0, *expected[:-1]])), "the state holds the reply's blocks"
    removed = {h for e in mine if e.WhichOneof("change") == "removed" for h in e.removed.block_hashes}
    assert not removed & set(expected)


async def test_a_reserve_holds_the_cached_prefix_and_returns_only_the_blocks_to_send(decode_worker, nc, smollm2_fp32):
    """The decode side of a handoff over real gRPC: a prompt whose first blocks this worker's
    prefix cache holds gets fresh blocks only for the rest (the prefill worker sends only those)."""
    _, instance_id = decode_worker
    idle = await _ready(nc, instance_id)
    history = smollm2_fp32.tokenizer.encode_chat([{"role": "user", "content": "List the planets of the solar system in order."}])
    done, subscription, _ = await _collect(nc, "reply-history")
    assert (await _assign(nc, instance_id, "reply-history", _request(history, 1))).WhichOneof("outcome") == "accepted"
    await asyncio.wait_for(done, 60)
    await subscription.unsubscribe()
    prompt = [*history, *range(1000, 1070)]
    num_blocks, num_cached_blocks = -(-len(prompt) // 16), len(history) // 16
    layout = KvLayout(
        model=idle.model, dtype="float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64, byte_order=sys.byteorder
    )
    async with internal_channel(idle.grpc_address, SECRET) as channel:
        stub = KvHandoffStub(channel)
        # A prefill group of another size holds other heads in each rank's blocks: refused, saying so.
        grouped = KvLayout()
        grouped.CopyFrom(layout)
        grouped.num_kv_heads, grouped.tensor_parallel_size = 1, 3
        refused = await stub.Reserve(ReserveRequest(reply_id="reply-tp", layout=grouped, num_blocks=1, request=_request(prompt, 4)))
        assert refused.refused.reason == "layout_mismatch" and "on 3 ranks" in refused.refused.message, refused
        reserve = ReserveRequest(reply_id="reply-reserve", layout=layout, num_blocks=num_blocks, request=_request(prompt, 4))
        reserved = await stub.Reserve(reserve, timeout=10)
        assert reserved.WhichOneof("outcome") == "reservation", reserved
        assert reserved.reservation.num_cached_blocks == num_cached_blocks > 0
        assert len(reserved.reservation.block_ids) == num_blocks - num_cached_blocks
        await _until_free(nc, instance_id, idle.kv_blocks_free - num_blocks)  # the cached blocks are held too
        # A retry of the same reply (its prefill worker died) replaces the reservation, never adds to it.
        again = await stub.Reserve(reserve, timeout=10)
        assert again.reservation.num_cached_blocks == num_cached_blocks
        await _until_free(nc, instance_id, idle.kv_blocks_free - num_blocks)
        assert (await stub.Release(ReleaseRequest(reply_id="reply-reserve"), timeout=10)).was_reserved
    await _until_free(nc, instance_id, idle.kv_blocks_free)


async def _until_free(nc, instance_id: str, num_free_blocks: int) -> None:
    async def heartbeats_until() -> None:
        while (await next_heartbeat(nc, "decode", instance_id, timeout_s=30)).kv_blocks_free != num_free_blocks:
            pass

    await asyncio.wait_for(heartbeats_until(), 30)


@pytest.fixture(scope="module")
def short_lease_decode_worker(nats_server, redis_server) -> Iterator[str]:
    env = service_env("decode", nats_server.url, redis_server.url, TANDEM_DTYPE="fp32", TANDEM_KV_CACHE_MIB="64", TANDEM_KV_LEASE_S="1.5")
    env["TANDEM_INTERNAL_SECRET"] = SECRET
    child = service_process("decode", env)
    child.start()
    yield env["TANDEM_INSTANCE_ID"]
    child.stop(timeout_s=10)


async def test_a_renewed_reservation_outlives_its_lease_and_an_unrenewed_one_expires(short_lease_decode_worker, nc):
    """A prefill worker renews while it prefills (that can take longer than one lease on a busy
    CPU); a silent one loses its blocks when the lease runs out."""
    idle = await _ready(nc, short_lease_decode_worker)
    layout = KvLayout(
        model=idle.model, dtype="float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64, byte_order=sys.byteorder
    )
    prompt = list(range(1000, 1100))  # 7 blocks, none cached
    async with internal_channel(idle.grpc_address, SECRET) as channel:
        stub = KvHandoffStub(channel)
        for reply_id in ("reply-renewed", "reply-silent"):
            reserved = await stub.Reserve(
                ReserveRequest(reply_id=reply_id, layout=layout, num_blocks=7, request=_request(prompt, 4)), timeout=10
            )
            assert reserved.WhichOneof("outcome") == "reservation" and reserved.reservation.lease_s == 1.5
        started_s = time.monotonic()
        renewals: list[bool] = []

        async def renew_forever() -> None:  # the prefill worker's cadence: a third of the lease
            while True:
                renewals.append((await stub.Renew(RenewRequest(reply_id="reply-renewed"), timeout=10)).is_reserved)
                await asyncio.sleep(0.5)

        renewing = asyncio.create_task(renew_forever())
        await _until_free(nc, short_lease_decode_worker, idle.kv_blocks_free - 7)  # only the silent one's blocks came back
        renewing.cancel()
        assert time.monotonic() - started_s >= 1.5
        assert renewals and all(renewals), "a renewed reservation expired"
        assert not (await stub.Renew(RenewRequest(reply_id="reply-silent"), timeout=10)).is_reserved
        assert (await stub.Release(ReleaseRequest(reply_id="reply-renewed"), timeout=10)).was_reserved
    await _until_free(nc, short_lease_decode_worker, idle.kv_blocks_free)
