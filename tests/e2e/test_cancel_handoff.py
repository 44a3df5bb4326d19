"""Cancelling a disaggregated reply wherever it is — waiting behind another prefill, during the
remote prefill, during the KV transfer, or decoding after the handoff — ends it with a cancelled
event and leaves every worker's free-block count where it started (nothing held or reserved).
Real router, prefill and decode processes on real NATS and UCXX.

The prefill worker's transfers are paced (TANDEM_KV_TRANSFER_MAX_BYTES_PER_S, a real setting) to
about 25 blocks a second, so a long prompt's transfer takes seconds and a cancel sent when its
first token is seen lands during the transfer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from helpers import next_heartbeat, service_env, service_process

from tandem.bus import decode, encode, subjects
from tandem.bus.token_batches import watch_events
from tandem.devstack.proc import ChildProcess
from tandem.models.loader import load_tokenizer
from tandem.models.tokenizer import Tokenizer
from tandem.v1 import common_pb2
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent

pytestmark = pytest.mark.real_model
FP32_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2-135M: layers, K/V, tokens, KV heads, head dim, fp32
BLOCKS_PER_S = 25


@pytest.fixture(scope="module")
def stack(nats_server, redis_server) -> Iterator[dict[str, str]]:
    children: list[ChildProcess] = []
    ids = {}
    for role in ("router", "prefill", "decode"):
        env = service_env(
            role,
            nats_server.url,
            redis_server.url,
            TANDEM_KV_CACHE_MIB="256",
            TANDEM_DTYPE="fp32",
            TANDEM_KV_TRANSFER_MAX_BYTES_PER_S=str(BLOCKS_PER_S * FP32_BLOCK_BYTES),
            # 512 tokens a step, prompts alone too (a configured budget binds them): a long prompt
            # takes several steps, each its whole budget, so the next one waits in the queue
            TANDEM_MAX_NUM_BATCHED_TOKENS="512",
        )
        child = service_process(role, env)
        child.start()
        children.append(child)
        ids[role] = env["TANDEM_INSTANCE_ID"]
    yield ids
    for child in children:  # shown with the last test's report when it fails
        print(f"==== {child.name}\n{child.recent_output(60)}")
        child.stop(timeout_s=10)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


def long_prompt(tokenizer: Tokenizer, place: str) -> list[int]:
    """A different long prompt per test, so no test finds another's blocks in a prefix cache."""
    story = " ".join(f"Line {i}: the river runs past the {place}, the hill and the old stone bridge." for i in range(90))
    prompt = tokenizer.encode_chat([{"role": "user", "content": f"{story}\nWrite a long poem about it."}])
    assert len(prompt) > 1500, "long enough that its prefill takes a while on a CPU"
    return prompt


async def _serving(nc, ids: dict[str, str]) -> dict[str, int]:
    """Once every part serves: each worker's free blocks, idle (the values to return to)."""
    for role in ("prefill", "decode"):
        await next_heartbeat(nc, role, ids[role], accept=lambda hb: hb.is_ready, timeout_s=180)
    await next_heartbeat(nc, "router", ids["router"], accept=lambda hb: hb.is_ready, timeout_s=60)
    return {role: (await next_heartbeat(nc, role, ids[role], timeout_s=30)).kv_blocks_free for role in ("prefill", "decode")}


async def _nothing_held(nc, ids: dict[str, str], free_at_start: dict[str, int]) -> None:
    """Every worker's free blocks return to their starting count. The engine applies a cancel at
    its next step, and one step of a long prefill chunk takes seconds on a CPU: wait for it."""
    for role in ("prefill", "decode"):
        try:
            heartbeat = await _worker_heartbeat_where(
                nc, role, ids[role], lambda hb, role=role: hb.kv_blocks_free == free_at_start[role] and not hb.queued_prefill_tokens
            )
        except TimeoutError:
            raise AssertionError(f"{role} still holds blocks a minute after the cancel") from None
        assert heartbeat.kv_blocks_free == heartbeat.kv_blocks_total


async def _worker_heartbeat_where(nc, role: str, instance_id: str, condition, timeout_s: float = 60):
    """The first heartbeat of a worker whose numbers meet `condition`."""

    async def first():
        while not condition(heartbeat := await next_heartbeat(nc, role, instance_id, timeout_s=timeout_s)):
            pass
        return heartbeat

    return await asyncio.wait_for(first(), timeout_s)


async def _start(nc, prompt: list[int]) -> tuple[str, asyncio.Queue[TokenEvent], object]:
    events: asyncio.Queue[TokenEvent] = asyncio.Queue()

    async def on_event(event: TokenEvent) -> None:  # workers' events (single or batched) and the router's finals
        events.put_nowait(event)

    subscription = await watch_events(nc, on_event)
    request = GenerateRequest(model="auto", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=300))
    reply = decode((await nc.request(subjects.GENERATE, encode(request), timeout=30)).data, GenerateReply)
    assert reply.WhichOneof("outcome") == "reply_id", reply
    return reply.reply_id, events, subscription


async def _until_first(events: asyncio.Queue[TokenEvent], reply_id: str) -> TokenEvent:
    while (event := await asyncio.wait_for(events.get(), 120)).reply_id != reply_id:
        pass
    return event


async def _until_finished(events: asyncio.Queue[TokenEvent], reply_id: str) -> list[TokenEvent]:
    seen = []
    while True:
        event = await asyncio.wait_for(events.get(), 120)
        if event.reply_id != reply_id:
            continue
        seen.append(event)
        if event.finish != common_pb2.FINISH_REASON_UNSPECIFIED:
            return seen


async def test_cancel_while_waiting_behind_another_prefill(stack, nc, tokenizer):
    free_at_start = await _serving(nc, stack)
    second_prompt = long_prompt(tokenizer, "forge")
    first_id, events, subscription = await _start(nc, long_prompt(tokenizer, "mill"))
    second_id, _, second_subscription = await _start(nc, second_prompt)
    # The first prefill takes every step's token budget: the second waits in the prefill worker's queue.
    waiting = await _worker_heartbeat_where(nc, "prefill", stack["prefill"], lambda hb: hb.waiting.free >= 1 and hb.running.free >= 1)
    assert waiting.queued_prefill_tokens > len(second_prompt), "its heartbeat counts the waiting prompt and the rest of the running one"
    await nc.publish(subjects.cancel(second_id), b"")
    second = await _until_finished(events, second_id)
    assert [(e.seq, e.finish, e.worker_id) for e in second] == [(1, common_pb2.FINISH_REASON_CANCELLED, stack["prefill"])]
    await nc.publish(subjects.cancel(first_id), b"")
    assert (await _until_finished(events, first_id))[-1].finish == common_pb2.FINISH_REASON_CANCELLED
    await subscription.unsubscribe()
    await second_subscription.unsubscribe()
    await _nothing_held(nc, stack, free_at_start)


async def test_cancel_during_the_remote_prefill(stack, nc, tokenizer):
    free_at_start = await _serving(nc, stack)
    reply_id, events, subscription = await _start(nc, long_prompt(tokenizer, "weir"))
    # The decode worker has reserved the blocks (it allocates first); the prefill is under way.
    await _worker_heartbeat_where(nc, "decode", stack["decode"], lambda hb: hb.kv_blocks_free < free_at_start["decode"])
    await nc.publish(subjects.cancel(reply_id), b"")
    seen = await _until_finished(events, reply_id)
    await subscription.unsubscribe()
    assert seen[-1].finish == common_pb2.FINISH_REASON_CANCELLED
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    await _nothing_held(nc, stack, free_at_start)


async def test_cancel_during_the_kv_transfer(stack, nc, tokenizer):
    free_at_start = await _serving(nc, stack)
    reply_id, events, subscription = await _start(nc, long_prompt(tokenizer, "quay"))
    first = await _until_first(events, reply_id)
    assert (first.seq, first.worker_id) == (1, stack["prefill"]), "the prefill worker's first token: the transfer starts now"
    await nc.publish(subjects.cancel(reply_id), b"")  # ~100 blocks at 25 a second: seconds of transfer left
    seen = [first, *await _until_finished(events, reply_id)]
    await subscription.unsubscribe()
    assert [(e.seq, e.finish) for e in seen] == [(1, 0), (2, common_pb2.FINISH_REASON_CANCELLED)]
    assert seen[-1].worker_id == stack["prefill"], "cancelled before the commit: the decode worker never ran it"
    await _nothing_held(nc, stack, free_at_start)


async def test_cancel_while_decoding_after_the_handoff(stack, nc, tokenizer):
    free_at_start = await _serving(nc, stack)
    reply_id, events, subscription = await _start(nc, long_prompt(tokenizer, "lock"))
    seen = []
    while len(seen) < 4 and not (seen and seen[-1].finish):  # the first token (prefill worker) and a few from the decode worker
        event = await asyncio.wait_for(events.get(), 120)
        if event.reply_id == reply_id:
            seen.append(event)
    assert not seen[-1].finish, f"the reply ended before the cancel: {seen[-1]}"
    assert seen[0].worker_id == stack["prefill"] and seen[-1].worker_id == stack["decode"]
    await nc.publish(subjects.cancel(reply_id), b"")
    seen += await _until_finished(events, reply_id)
    await subscription.unsubscribe()
    assert seen[-1].finish == common_pb2.FINISH_REASON_CANCELLED
    assert len(seen) < 300
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    await _nothing_held(nc, stack, free_at_start)
