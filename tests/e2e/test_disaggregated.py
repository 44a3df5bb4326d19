"""Disaggregated serving end to end, every part a real process on real NATS: a long prompt is
prefilled on a prefill worker, its KV moves to a decode worker over UCXX, and the reply equals
the in-process engine's token for token (one, then sixteen at once); a short one prefills on its
decode worker; a follow-up turn goes back to the decode worker whose prefix cache holds its
history (the router knows from KV events) and prefills only its new part there; and a decode
worker killed between reserve and commit leaves the reply to the other one.

Two prefill and two decode workers, so "the same worker" is a choice the router makes, not the
only option. The router sends prompts above REMOTE_PREFILL_MIN_TOKENS uncached tokens to a
prefill worker (TANDEM_REMOTE_PREFILL_MIN_TOKENS), low so short prompts keep the test quick."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import torch
from helpers import next_heartbeat, service_env, service_process

from tandem.bus import decode, encode, subjects
from tandem.bus.token_batches import watch_events
from tandem.devstack.proc import ChildProcess
from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.models.loader import LoadedModel, load_model
from tandem.v1 import common_pb2
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.v1.worker_pb2 import WorkerHeartbeat

pytestmark = pytest.mark.real_model
MAX_TOKENS = 24
REMOTE_PREFILL_MIN_TOKENS = 96
WORDS = [
    "river",
    "mountain",
    "harbour",
    "ferry",
    "island",
    "lantern",
    "meadow",
    "orchard",
    "bridge",
    "castle",
    "valley",
    "market",
    "garden",
    "forest",
]


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load_model(None, torch.float32, "cpu", select_attention("cpu"))


@dataclass(frozen=True)
class Stack:
    router: str
    router_url: str
    prefill: tuple[str, str]
    decode: tuple[str, str]
    pids: dict[str, int]
    stopped: set[str] = field(default_factory=set)  # workers a test stopped or killed

    def workers(self) -> list[tuple[str, str]]:
        """The workers still running."""
        every = [*(("prefill", p) for p in self.prefill), *(("decode", d) for d in self.decode)]
        return [(role, instance_id) for role, instance_id in every if instance_id not in self.stopped]


@pytest.fixture(scope="module")
def stack(nats_server, redis_server) -> Iterator[Stack]:
    children: list[ChildProcess] = []
    envs = []
    for role in ("router", "prefill", "prefill", "decode", "decode"):
        env = service_env(
            role,
            nats_server.url,
            redis_server.url,
            TANDEM_DTYPE="fp32",
            TANDEM_KV_CACHE_MIB="128",
            TANDEM_REMOTE_PREFILL_MIN_TOKENS=str(REMOTE_PREFILL_MIN_TOKENS),
            # 512 tokens a step, prompts alone too (a configured budget binds them): a prefill of
            # ~1,000 tokens spans steps, so the drain test sees it queued in a heartbeat and stops
            # its worker mid-prefill
            TANDEM_MAX_NUM_BATCHED_TOKENS="512",
        )
        child = service_process(role, env)
        child.start()
        children.append(child)
        envs.append(env)
    router, prefill_1, prefill_2, decode_1, decode_2 = ids = [env["TANDEM_INSTANCE_ID"] for env in envs]
    pids = {instance_id: child.pid for instance_id, child in zip(ids, children)}
    yield Stack(router, f"http://127.0.0.1:{envs[0]['TANDEM_HTTP_PORT']}", (prefill_1, prefill_2), (decode_1, decode_2), pids)
    for child in children:  # shown with the last test's report when it fails
        print(f"==== {child.name}\n{child.recent_output(60)}")
        child.stop(timeout_s=10)


async def _ask(nc, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[TokenEvent]:
    """One reply's events, to its last; the caller chooses the reply id, so concurrent asks each
    hear only their own reply."""
    reply_id = uuid.uuid4().hex
    events: list[TokenEvent] = []
    done = asyncio.get_running_loop().create_future()

    async def on_event(event: TokenEvent) -> None:
        events.append(event)
        if event.finish != common_pb2.FINISH_REASON_UNSPECIFIED and not done.done():
            done.set_result(None)

    subscription = await watch_events(nc, on_event, reply_id)
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens)
    request = GenerateRequest(model="auto", prompt_token_ids=prompt, sampling=sampling, reply_id=reply_id)
    reply = decode((await nc.request(subjects.GENERATE, encode(request), timeout=30)).data, GenerateReply)
    assert reply.WhichOneof("outcome") == "reply_id" and reply.reply_id == reply_id, reply
    await asyncio.wait_for(done, 180)
    await subscription.unsubscribe()
    return events


def _expected(model: LoadedModel, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    engine = Engine(model, EngineConfig(kv_cache_mib=64))
    stream = engine.generate([Request("x", tuple(prompt), SamplingOptions(max_tokens=max_tokens))])["x"]
    return [t for o in stream for t in o.new_token_ids]


async def _blocks_back_to(nc, stack: Stack, free_at_start: dict[str, int]) -> None:
    """Every running worker's free-block count is back where it started (two heartbeats: the first may predate the end)."""
    for role, instance_id in stack.workers():
        await next_heartbeat(nc, role, instance_id, timeout_s=30)
        after = await next_heartbeat(nc, role, instance_id, timeout_s=30)
        assert after.kv_blocks_free == free_at_start[instance_id] == after.kv_blocks_total, instance_id


async def _all_serving(nc, stack: Stack) -> dict[str, object]:
    beats = {}
    for role, instance_id in stack.workers():
        beats[instance_id] = await next_heartbeat(nc, role, instance_id, accept=lambda hb: hb.is_ready, timeout_s=180)
    await next_heartbeat(nc, "router", stack.router, accept=lambda hb: hb.is_ready, timeout_s=60)
    # The router learns of the workers from the same heartbeats; one more round reaches it too.
    for role, instance_id in stack.workers():
        await next_heartbeat(nc, role, instance_id, timeout_s=30)
    return beats


async def _router_has_every_kv_event(nc, stack: Stack, decode_id: str) -> None:
    """Until the router's prefix index has applied every KV event the (idle) decode worker
    published: its heartbeats agree twice on the last id, then a bounded poll of /workers."""
    published = (await next_heartbeat(nc, "decode", decode_id, timeout_s=30)).kv_event_id
    while (latest := (await next_heartbeat(nc, "decode", decode_id, timeout_s=30)).kv_event_id) != published:
        published = latest
    assert published > 0, "the decode worker published KV events"
    deadline = time.monotonic() + 10
    async with httpx.AsyncClient(base_url=stack.router_url) as http:
        while True:
            listed = {w["instance_id"]: w for w in (await http.get("/workers")).json()["decode"]}
            if listed.get(decode_id, {}).get("kv_event_id", 0) >= published:
                return
            assert time.monotonic() < deadline, f"the router has {listed.get(decode_id)}, the worker published {published}"
            await asyncio.sleep(0.05)


async def test_a_long_prompt_is_prefilled_remotely_and_decoded_exactly(stack, nc, model):
    idle = await _all_serving(nc, stack)
    story = " ".join(f"Sentence {i} of a long document about rivers, mountains and the sea." for i in range(30))
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": f"{story}\nSummarise this in one line."}])
    assert len(prompt) > 256, "long enough for the router to choose remote prefill"
    events = await _ask(nc, prompt)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.token_id for e in events] == _expected(model, prompt)
    assert events[0].worker_id in stack.prefill, "the first token comes from a prefill worker"
    decode_ids = {e.worker_id for e in events[1:]}
    assert len(decode_ids) == 1 and decode_ids <= set(stack.decode), "the rest from one decode worker"
    assert events[-1].usage.input_tokens == len(prompt) and events[-1].usage.output_tokens == len(events)
    # Nothing stays reserved or held anywhere.
    await _blocks_back_to(nc, stack, {i: hb.kv_blocks_free for i, hb in idle.items()})


def _seeded_prompt(model: LoadedModel, rng: random.Random) -> list[int]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(90, 140)))
    return model.tokenizer.encode_chat([{"role": "user", "content": f"{words}\nWhich of these words comes most often?"}])


async def test_sixteen_concurrent_replies_over_two_prefill_and_two_decode_workers_equal_the_engine(stack, nc, model):
    idle = await _all_serving(nc, stack)
    rng = random.Random(20261129)
    prompts = [_seeded_prompt(model, rng) for _ in range(16)]
    assert all(len(p) > REMOTE_PREFILL_MIN_TOKENS for p in prompts), "every one is long enough to prefill remotely"
    replies = await asyncio.gather(*(_ask(nc, p, max_tokens=8) for p in prompts))
    for prompt, events in zip(prompts, replies):
        shown = [(e.seq, e.token_id, e.worker_id, e.finish, e.error.message) for e in events]
        assert [e.seq for e in events] == list(range(1, len(events) + 1)), shown
        assert [e.token_id for e in events] == _expected(model, prompt, max_tokens=8), shown
        assert events[0].worker_id in stack.prefill and len({e.worker_id for e in events[1:]}) == 1
        assert events[-1].worker_id in stack.decode
        usage = events[-1].usage
        assert (usage.input_tokens, usage.output_tokens) == (len(prompt), len(events))
        assert usage.cached_tokens % 16 == 0 and usage.cached_tokens < len(prompt)
    assert {r[0].worker_id for r in replies} == set(stack.prefill), "both prefill workers took replies"
    assert {r[-1].worker_id for r in replies} == set(stack.decode), "both decode workers took replies"
    await _blocks_back_to(nc, stack, {i: hb.kv_blocks_free for i, hb in idle.items()})


async def test_a_short_prompt_prefills_on_its_decode_worker(stack, nc, model):
    await _all_serving(nc, stack)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    events = await _ask(nc, prompt)
    assert len({e.worker_id for e in events}) == 1 and events[0].worker_id in stack.decode
    assert [e.token_id for e in events] == _expected(model, prompt)
    assert "Paris" in "".join(e.text for e in events)


async def test_a_follow_up_turn_returns_to_the_decode_worker_holding_its_history_and_prefills_there(stack, nc, model):
    await _all_serving(nc, stack)
    log = " ".join(f"Day {i}: the ferry left the harbour at dawn and crossed the bay to the island." for i in range(25))
    first_prompt = model.tokenizer.encode_chat([{"role": "user", "content": f"{log}\nWhat did the ferry do each day?"}])
    first = await _ask(nc, first_prompt)
    assert len(first_prompt) > 256 and first[0].worker_id in stack.prefill, "turn 1 is long and uncached: remote prefill"
    decode_id = first[-1].worker_id
    assert decode_id in stack.decode
    await _router_has_every_kv_event(nc, stack, decode_id)

    # Turn 2 as the chat service builds it: turn 1's prompt, its reply, then the new message.
    reply = [e.token_id for e in first]
    closing = [] if reply[-1] in model.eos_token_ids else model.tokenizer.encode("<|im_end|>")
    new_message = model.tokenizer.encode("\n<|im_start|>user\nAnd in five words?<|im_end|>\n<|im_start|>assistant\n")
    second_prompt = [*first_prompt, *reply, *closing, *new_message]
    assert len(second_prompt) - len(first_prompt) < REMOTE_PREFILL_MIN_TOKENS < len(second_prompt), (
        "long enough that, uncached, it would go to a prefill worker; its new part is short"
    )
    second = await _ask(nc, second_prompt)
    assert {e.worker_id for e in second} == {decode_id}, "the worker holding turn 1, prefilling turn 2 itself"
    usage = second[-1].usage
    assert usage.input_tokens == len(second_prompt)
    assert usage.cached_tokens >= len(first_prompt) // 16 * 16, "turn 1's prompt came from the prefix cache"


def _next_turn(model: LoadedModel, prompt: list[int], reply: list[int], message: str) -> list[int]:
    """The next turn's prompt as the chat service builds it: the last prompt, its reply, the new message."""
    closing = [] if reply[-1] in model.eos_token_ids else model.tokenizer.encode("<|im_end|>")
    new_message = model.tokenizer.encode(f"\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n")
    return [*prompt, *reply, *closing, *new_message]


async def test_concurrent_conversations_each_return_to_their_decode_worker_for_turn_two(stack, nc, model):
    """One conversation per decode worker, their second turns at once: each goes back to the worker
    holding its first. (Two second turns for one worker at once may rightly be split: the router
    weighs a reply already placed there against prefilling the other's short history elsewhere.)"""
    idle = await _all_serving(nc, stack)
    rng = random.Random(4242)
    candidates = [_seeded_prompt(model, rng) for _ in range(4)]
    answers = await asyncio.gather(*(_ask(nc, p, max_tokens=8) for p in candidates))
    assert all(a[0].worker_id in stack.prefill for a in answers), "turn 1 is long and uncached: remote prefill"
    one_per_worker = {a[-1].worker_id: (p, a) for p, a in zip(candidates, answers)}
    assert set(one_per_worker) == set(stack.decode), "four concurrent first turns spread over both decode workers"
    first_prompts = [p for p, _ in one_per_worker.values()]
    firsts = [a for _, a in one_per_worker.values()]
    for decode_id in one_per_worker:
        await _router_has_every_kv_event(nc, stack, decode_id)
    second_prompts = [_next_turn(model, p, [e.token_id for e in f], "And which comes least often?") for p, f in zip(first_prompts, firsts)]
    seconds = await asyncio.gather(*(_ask(nc, p, max_tokens=8) for p in second_prompts))
    for first_prompt, first, second_prompt, second in zip(first_prompts, firsts, second_prompts, seconds):
        assert {e.worker_id for e in second} == {first[-1].worker_id}, "its decode worker, prefilling turn 2 itself"
        assert [e.seq for e in second] == list(range(1, len(second) + 1))
        assert [e.token_id for e in second] == _expected(model, second_prompt, max_tokens=8)
        usage = second[-1].usage
        assert (usage.input_tokens, usage.output_tokens) == (len(second_prompt), len(second))
        assert usage.cached_tokens >= len(first_prompt) // 16 * 16, "turn 1's prompt came from the prefix cache"
    await _blocks_back_to(nc, stack, {i: hb.kv_blocks_free for i, hb in idle.items()})


async def _first_worker_where(nc, role: str, condition) -> str:
    """The first worker of `role` whose heartbeat meets `condition`."""
    chosen: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_heartbeat(msg):
        heartbeat = decode(msg.data, WorkerHeartbeat)
        if condition(heartbeat) and not chosen.done():
            chosen.set_result(heartbeat.service.instance_id)

    subscription = await nc.subscribe(subjects.heartbeats_of(role), cb=on_heartbeat)
    try:
        return await asyncio.wait_for(chosen, 60)
    finally:
        await subscription.unsubscribe()


async def test_a_prefill_worker_stopped_mid_prefill_loses_nothing(stack, nc, model):
    """Near the end of this module: it stops one of the prefill workers (SIGTERM, as a rolling
    restart does). It drains: the prefill in progress either finishes there and is handed over,
    or goes back to the router for the other prefill worker, whichever the drain reaches first.
    The user sees neither an error nor a cancel, and no token twice."""
    idle = await _all_serving(nc, stack)
    free_at_start = {i: hb.kv_blocks_free for i, hb in idle.items()}
    story = " ".join(f"Entry {i}: the miller ground the wheat and sent the flour down the river." for i in range(60))
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": f"{story}\nWhat did the miller do?"}])
    asked = asyncio.create_task(_ask(nc, prompt))
    stopping = await _first_worker_where(nc, "prefill", lambda hb: hb.queued_prefill_tokens > 0)
    os.kill(stack.pids[stopping], signal.SIGTERM)
    stack.stopped.add(stopping)
    events = await asked
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.token_id for e in events] == _expected(model, prompt)
    assert events[-1].finish in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert events[0].worker_id in stack.prefill
    await _blocks_back_to(nc, stack, free_at_start)


async def test_a_decode_worker_killed_between_reserve_and_commit_leaves_the_reply_to_the_other(stack, nc, model):
    """Last in this module: it kills one of the decode workers."""
    idle = await _all_serving(nc, stack)
    free_at_start = {i: hb.kv_blocks_free for i, hb in idle.items()}
    story = " ".join(f"Entry {i}: the keeper lit the lighthouse lamp and logged the passing ships." for i in range(60))
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": f"{story}\nWhat did the keeper do?"}])
    asked = asyncio.create_task(_ask(nc, prompt))
    # The decode worker whose free blocks drop is the one reserved on; the prefill of ~1,000 tokens runs.
    killed = await _first_worker_where(nc, "decode", lambda hb: hb.kv_blocks_free < free_at_start.get(hb.service.instance_id, 0))
    os.kill(stack.pids[killed], signal.SIGKILL)
    stack.stopped.add(killed)
    events = await asked
    survivor = next(d for d in stack.decode if d != killed)
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), "no token lost or repeated across the retry"
    assert [e.token_id for e in events] == _expected(model, prompt)
    assert events[-1].finish in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert killed not in {e.worker_id for e in events}, "killed before its commit: it never ran the reply"
    assert events[-1].worker_id == survivor
    assert (events[-1].usage.input_tokens, events[-1].usage.output_tokens) == (len(prompt), len(events))
    await _blocks_back_to(nc, stack, free_at_start)  # the prefill workers and the survivor
