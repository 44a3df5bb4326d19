"""Queues bounded by time, on a real decode worker process and real NATS: once the worker has
measured its prefill rate (after a warm-up request), a free assignment that would wait behind queued work longer than its
(tiny) TTFT target is refused "queue_full" with a time to retry and nothing kept, while a paid one
offered at the same moment is taken (free work is not ahead of it), and so is a free continuation
(its reply already streams); the heartbeat says what a free request would wait.

No timing is asserted: one seat (max_num_seqs=1) held by a long paid reply keeps the queue there
for as long as the test needs it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator

import pytest
from helpers import next_heartbeat, service_env, service_process

from tandem.bus import decode, encode, subjects
from tandem.bus.token_batches import watch_events
from tandem.devstack.proc import ChildProcess
from tandem.models.loader import load_tokenizer
from tandem.models.tokenizer import Tokenizer
from tandem.v1 import common_pb2
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.v1.worker_pb2 import WorkerHeartbeat

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def busy_worker(nats_server, redis_server) -> Iterator[str]:
    env = service_env(
        "decode",
        nats_server.url,
        redis_server.url,
        TANDEM_DTYPE="fp32",
        TANDEM_KV_CACHE_MIB="64",
        TANDEM_MAX_NUM_SEQS="1",
        TANDEM_TTFT_TARGET_FREE_S="0.001",
        TANDEM_TTFT_TARGET_PAID_S="1000",
        TANDEM_CPU_TTFT_SCALE="1",
    )
    child: ChildProcess = service_process("decode", env)
    child.start()
    yield env["TANDEM_INSTANCE_ID"]
    child.stop(timeout_s=10)


def _request(prompt_ids: list[int], lane: int, max_tokens: int, user_id: str) -> GenerateRequest:
    return GenerateRequest(
        model="auto",
        prompt_token_ids=prompt_ids,
        lane=lane,
        user_id=user_id,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )


async def _assign(nc, instance_id: str, reply_id: str, request: GenerateRequest, epoch: int = 0) -> AssignmentReply:
    assignment = Assignment(reply_id=reply_id, request=request, first_seq=1, epoch=epoch)
    msg = await nc.request(subjects.assign(instance_id), encode(assignment), timeout=30)
    return decode(msg.data, AssignmentReply)


async def _worker_heartbeat(nc, instance_id: str, accept: Callable[[WorkerHeartbeat], bool], timeout_s: float = 30) -> WorkerHeartbeat:
    found: asyncio.Future[WorkerHeartbeat] = asyncio.get_running_loop().create_future()

    async def on_message(msg) -> None:
        heartbeat = decode(msg.data, WorkerHeartbeat)
        if accept(heartbeat) and not found.done():
            found.set_result(heartbeat)

    subscription = await nc.subscribe(subjects.heartbeat("decode", instance_id), cb=on_message)
    try:
        return await asyncio.wait_for(found, timeout_s)
    finally:
        await subscription.unsubscribe()


@functools.cache
def _prompt(text: str) -> list[int]:
    return _tokenizer().encode_chat([{"role": "user", "content": text}])


@functools.cache
def _tokenizer() -> Tokenizer:
    return load_tokenizer(None)


async def test_a_free_assignment_that_would_wait_past_its_target_is_refused_queue_full_while_paid_is_taken(busy_worker, nc):
    instance_id = busy_worker
    _tokenizer()  # loaded before the clock matters: the queue must still be there when the offers come
    await next_heartbeat(nc, "decode", instance_id, accept=lambda hb: hb.is_ready, timeout_s=120)
    first_token = {"reply-warm-up": asyncio.Event(), "reply-seat": asyncio.Event()}

    async def on_token(token: TokenEvent) -> None:
        if (event := first_token.get(token.reply_id)) is not None:
            event.set()

    tokens = await watch_events(nc, on_token)
    try:
        # The engine's first prefill step pays its warm-up and is not measured.
        warm_up = _request(_prompt("Hi"), common_pb2.LANE_PAID, 1, "holder")
        assert (await _assign(nc, instance_id, "reply-warm-up", warm_up)).WhichOneof("outcome") == "accepted"
        await asyncio.wait_for(first_token["reply-warm-up"].wait(), 120)
        # A long paid reply takes the only seat; its prefill step, over a quarter of the step
        # budget, measures the prefill rate.
        chapters = " ".join(f"Chapter {i}: the dragon slept under the mountain all winter." for i in range(16))
        seat = _request(_prompt(f"{chapters}\nTell me a very long story about a dragon."), common_pb2.LANE_PAID, 2000, "holder")
        assert (await _assign(nc, instance_id, "reply-seat", seat)).WhichOneof("outcome") == "accepted"
        await asyncio.wait_for(first_token["reply-seat"].wait(), 120)

        # Nothing waits yet: a free request would start at once, and is queued behind the seat.
        queued = _request(_prompt("What is the capital of France?"), common_pb2.LANE_FREE, 8, "alice")
        assert (await _assign(nc, instance_id, "reply-queued", queued)).WhichOneof("outcome") == "accepted"

        # Now a free request waits behind the queued one's prefill: longer than 1 ms at any rate.
        refused = await _assign(nc, instance_id, "reply-refused", _request(_prompt("Hello!"), common_pb2.LANE_FREE, 8, "bob"))
        assert refused.WhichOneof("outcome") == "refused"
        assert refused.refused.reason == "queue_full"
        assert refused.refused.retry_after_s > 0
        assert "would wait" in refused.refused.message

        # A free continuation (its first owner was lost mid-answer) waiting just as long is taken:
        # refused everywhere, its reply would end in an error.
        continued = _request(_prompt("Hello!"), common_pb2.LANE_FREE, 8, "dave")
        continued.resume_reply_id = continued.reply_id = "reply-continued"
        continued.generated_token_ids.extend(_tokenizer().encode("Hi"))
        continued.epoch = 1
        assert (await _assign(nc, instance_id, "reply-continued", continued, epoch=1)).WhichOneof("outcome") == "accepted"

        # Free work is not ahead of paid work: a paid request is taken at the same moment.
        paid = _request(_prompt("Hello!"), common_pb2.LANE_PAID, 8, "carol")
        assert (await _assign(nc, instance_id, "reply-paid", paid)).WhichOneof("outcome") == "accepted"

        # The engine takes the queued requests between two steps: their heartbeat comes once it has.
        heartbeat = await _worker_heartbeat(nc, instance_id, lambda hb: hb.waiting.free == 2 and hb.waiting.paid == 1)
        assert heartbeat.prefill_tokens_per_s > 0 and heartbeat.estimated_wait_s > 0
        assert heartbeat.free_ttft_target_s == pytest.approx(0.001)  # its free target, CPU scale 1
        assert "reply-refused" not in heartbeat.reply_ids  # the refused reply was not kept
        assert {"reply-seat", "reply-queued", "reply-paid", "reply-continued"} <= set(heartbeat.reply_ids)
    finally:
        await tokens.unsubscribe()
        for reply_id in ("reply-seat", "reply-queued", "reply-paid", "reply-continued"):
            await nc.publish(subjects.cancel(reply_id), b"")
