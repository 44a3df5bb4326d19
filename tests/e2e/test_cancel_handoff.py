"""Cancelling a disaggregated reply wherever it is — during the remote prefill, or decoding after
the handoff — ends it with a cancelled event and leaves no block held or reserved on either
worker. Real router, prefill and decode processes on real NATS."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from helpers import next_heartbeat, service_env, service_process

from tandem.bus import decode, encode, subjects
from tandem.models.loader import load_tokenizer
from tandem.proc import ChildProcess
from tandem.v1 import common_pb2
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent

pytestmark = [pytest.mark.e2e, pytest.mark.real_model]


@pytest.fixture(scope="module")
def stack(nats_server, redis_server) -> Iterator[dict[str, str]]:
    children: list[ChildProcess] = []
    ids = {}
    for role in ("router", "prefill", "decode"):
        env = service_env(role, nats_server.url, redis_server.url, TANDEM_KV_CACHE_MIB="128")
        child = service_process(role, env)
        child.start()
        children.append(child)
        ids[role] = env["TANDEM_INSTANCE_ID"]
    yield ids
    for child in children:
        child.stop(timeout_s=10)


@pytest.fixture(scope="module")
def long_prompt() -> list[int]:
    tokenizer = load_tokenizer(None)
    story = " ".join(f"Line {i}: the river runs past the mill, the hill and the old stone bridge." for i in range(90))
    prompt = tokenizer.encode_chat([{"role": "user", "content": f"{story}\nWrite a long poem about it."}])
    assert len(prompt) > 1500, "long enough that its prefill takes a while on a CPU"
    return prompt


async def _serving(nc, ids: dict[str, str]) -> None:
    for role in ("prefill", "decode"):
        await next_heartbeat(nc, role, ids[role], accept=lambda hb: hb.is_ready, timeout_s=180)
    await next_heartbeat(nc, "router", ids["router"], accept=lambda hb: hb.is_ready, timeout_s=60)
    for role in ("prefill", "decode"):
        await next_heartbeat(nc, role, ids[role], timeout_s=30)


async def _nothing_held(nc, ids: dict[str, str]) -> None:
    for role in ("prefill", "decode"):
        await next_heartbeat(nc, role, ids[role], timeout_s=30)  # one that may predate the cancel
        heartbeat = await next_heartbeat(nc, role, ids[role], timeout_s=30)
        assert heartbeat.kv_blocks_free == heartbeat.kv_blocks_total, f"{role} still holds blocks"


async def _start(nc, prompt: list[int]) -> tuple[str, asyncio.Queue[TokenEvent], object]:
    events: asyncio.Queue[TokenEvent] = asyncio.Queue()

    async def on_event(msg):
        events.put_nowait(decode(msg.data, TokenEvent))

    subscription = await nc.subscribe("tandem.v1.tokens.*", cb=on_event)
    request = GenerateRequest(model="auto", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=300))
    reply = decode((await nc.request(subjects.GENERATE, encode(request), timeout=30)).data, GenerateReply)
    assert reply.WhichOneof("outcome") == "reply_id", reply
    return reply.reply_id, events, subscription


async def _until_finished(events: asyncio.Queue[TokenEvent], reply_id: str) -> list[TokenEvent]:
    seen = []
    while True:
        event = await asyncio.wait_for(events.get(), 120)
        if event.reply_id != reply_id:
            continue
        seen.append(event)
        if event.finish != common_pb2.FINISH_REASON_UNSPECIFIED:
            return seen


async def test_cancel_during_the_remote_prefill(stack, nc, long_prompt):
    await _serving(nc, stack)
    reply_id, events, subscription = await _start(nc, long_prompt)
    await nc.publish(subjects.cancel(reply_id), b"")  # the prefill of ~1,700 tokens has barely begun
    seen = await _until_finished(events, reply_id)
    await subscription.unsubscribe()
    assert seen[-1].finish == common_pb2.FINISH_REASON_CANCELLED
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    await _nothing_held(nc, stack)


async def test_cancel_while_decoding_after_the_handoff(stack, nc, long_prompt):
    await _serving(nc, stack)
    reply_id, events, subscription = await _start(nc, long_prompt)
    seen = []
    while len(seen) < 4:  # the first token (prefill worker) and a few from the decode worker
        event = await asyncio.wait_for(events.get(), 120)
        if event.reply_id == reply_id:
            seen.append(event)
    assert seen[0].worker_id == stack["prefill"] and seen[-1].worker_id == stack["decode"]
    await nc.publish(subjects.cancel(reply_id), b"")
    seen += await _until_finished(events, reply_id)
    await subscription.unsubscribe()
    assert seen[-1].finish == common_pb2.FINISH_REASON_CANCELLED
    assert len(seen) < 300
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    await _nothing_held(nc, stack)
