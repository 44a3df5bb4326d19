"""Disaggregated serving end to end, every part a real process on real NATS: a long prompt is
prefilled on the prefill worker, its KV moves to the decode worker over UCXX, and the reply
equals the in-process engine's token for token; a short one prefills on its decode worker."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from conftest import next_heartbeat, service_env, service_process

from tandem.bus import decode, encode, subjects
from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.models.loader import LoadedModel, load_model
from tandem.proc import ChildProcess
from tandem.v1 import common_pb2
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent

pytestmark = [pytest.mark.e2e, pytest.mark.real_model]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return load_model(None, torch.float32, "cpu", select_attention("cpu"))


@pytest.fixture(scope="module")
def stack(nats_server, redis_server) -> Iterator[dict[str, str]]:
    children: list[ChildProcess] = []
    ids = {}
    for role in ("router", "prefill", "decode"):
        env = service_env(role, nats_server.url, redis_server.url, TANDEM_DTYPE="fp32", TANDEM_KV_CACHE_MIB="64")
        child = service_process(role, env)
        child.start()
        children.append(child)
        ids[role] = env["TANDEM_INSTANCE_ID"]
    yield ids
    for child in children:
        child.stop(timeout_s=10)


async def _ask(nc, prompt: list[int]) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    done = asyncio.get_running_loop().create_future()

    async def on_event(msg):
        event = decode(msg.data, TokenEvent)
        events.append(event)
        if event.finish != common_pb2.FINISH_REASON_UNSPECIFIED and not done.done():
            done.set_result(None)

    subscription = await nc.subscribe("tandem.v1.tokens.*", cb=on_event)
    request = GenerateRequest(model="auto", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    reply = decode((await nc.request(subjects.GENERATE, encode(request), timeout=30)).data, GenerateReply)
    assert reply.WhichOneof("outcome") == "reply_id", reply
    await asyncio.wait_for(done, 180)
    await subscription.unsubscribe()
    return [e for e in events if e.reply_id == reply.reply_id]


def _expected(model: LoadedModel, prompt: list[int]) -> list[int]:
    engine = Engine(model, EngineConfig(kv_cache_mib=64))
    stream = engine.generate([Request("x", tuple(prompt), SamplingOptions(max_tokens=MAX_TOKENS))])["x"]
    return [t for o in stream for t in o.new_token_ids]


async def _all_serving(nc, ids: dict[str, str]) -> dict[str, object]:
    beats = {}
    for role in ("prefill", "decode"):
        beats[role] = await next_heartbeat(nc, role, ids[role], accept=lambda hb: hb.is_ready, timeout_s=180)
    await next_heartbeat(nc, "router", ids["router"], accept=lambda hb: hb.is_ready, timeout_s=60)
    # The router learns of the workers from the same heartbeats; one more round reaches it too.
    for role in ("prefill", "decode"):
        await next_heartbeat(nc, role, ids[role], timeout_s=30)
    return beats


async def test_a_long_prompt_is_prefilled_remotely_and_decoded_exactly(stack, nc, model):
    idle = await _all_serving(nc, stack)
    story = " ".join(f"Sentence {i} of a long document about rivers, mountains and the sea." for i in range(30))
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": f"{story}\nSummarise this in one line."}])
    assert len(prompt) > 256, "long enough for the router to choose remote prefill"
    events = await _ask(nc, prompt)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.token_id for e in events] == _expected(model, prompt)
    assert events[0].worker_id == stack["prefill"], "the first token comes from the prefill worker"
    assert {e.worker_id for e in events[1:]} == {stack["decode"]}, "the rest from the decode worker"
    assert events[-1].usage.input_tokens == len(prompt) and events[-1].usage.output_tokens == len(events)
    # Nothing stays reserved or held on either side.
    for role in ("prefill", "decode"):
        await next_heartbeat(nc, role, stack[role], timeout_s=30)
        after = await next_heartbeat(nc, role, stack[role], timeout_s=30)
        assert after.kv_blocks_free == idle[role].kv_blocks_free == after.kv_blocks_total, role


async def test_a_short_prompt_prefills_on_its_decode_worker(stack, nc, model):
    await _all_serving(nc, stack)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    events = await _ask(nc, prompt)
    assert {e.worker_id for e in events} == {stack["decode"]}
    assert [e.token_id for e in events] == _expected(model, prompt)
    assert "Paris" in "".join(e.text for e in events)
