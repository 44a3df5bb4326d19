"""The OpenAI-compatible endpoints against the whole stack: /v1/models, chat completions
streamed and not, sampling options honoured, and OpenAI's error shape; the ops paths (/metrics,
/openapi.json, ...) only on the chat's ops port, and the public /health without Redis."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time

import httpx
import jsonschema
import nats
import openai
import pytest
from helpers import freeze
from product_stack import ALICE
from pydantic import BaseModel, Field

import tandem
from tandem.bus import encode, subjects
from tandem.kernels.metadata import BLOCK_SIZE
from tandem.models.loader import load_tokenizer
from tandem.v1.tokens_pb2 import Cancel

pytestmark = pytest.mark.real_model
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
OPS_PATHS = ("/metrics", "/readyz", "/healthz", "/version", "/docs", "/redoc", "/openapi.json")  # the ops port's, never the public one's


async def served_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models", headers=ALICE)
    assert response.status_code == 200
    models = response.json()["data"]
    assert models and models[0]["object"] == "model"
    # Served since the decode worker started: within the last hour, not a constant.
    assert time.time() - 3600 < models[0]["created"] <= time.time()
    return models[0]["id"]


async def test_a_completion_answers_with_usage(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        model = await served_model(client)
        response = await client.post(
            "/v1/chat/completions", headers=ALICE, json={"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 16}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "chat.completion" and body["model"] == model
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and "Paris" in choice["message"]["content"]
        assert choice["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["prompt_tokens"] > 5 and 0 < usage["completion_tokens"] <= 16
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_a_streamed_completion_equals_the_whole_one_and_ends_with_done(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        model = await served_model(client)
        request = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 16}
        whole = (await client.post("/v1/chat/completions", headers=ALICE, json=request)).json()
        chunks, saw_done = [], False
        async with client.stream(
            "POST", "/v1/chat/completions", headers=ALICE, json={**request, "stream": True, "stream_options": {"include_usage": True}}
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    saw_done = True
                    break
                chunks.append(json.loads(line.removeprefix("data: ")))
        assert saw_done
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == whole["choices"][0]["message"]["content"]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finishes == [whole["choices"][0]["finish_reason"]]
        assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


async def test_max_tokens_stop_and_seed_are_honoured(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        model = await served_model(client)
        short = (
            await client.post(
                "/v1/chat/completions", headers=ALICE, json={"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 3}
            )
        ).json()
        assert short["usage"]["completion_tokens"] == 3 and short["choices"][0]["finish_reason"] == "length"
        stopped = (
            await client.post(
                "/v1/chat/completions",
                headers=ALICE,
                json={"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 30, "stop": ["Paris"]},
            )
        ).json()
        assert "Paris" not in stopped["choices"][0]["message"]["content"]
        assert stopped["choices"][0]["finish_reason"] == "stop"
        seeded = {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a word."}],
            "temperature": 1.0,
            "seed": 11,
            "max_tokens": 12,
        }
        first = (await client.post("/v1/chat/completions", headers=ALICE, json=seeded)).json()
        second = (await client.post("/v1/chat/completions", headers=ALICE, json=seeded)).json()
        assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


async def test_errors_have_openais_shape(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=30) as client:
        unknown = await client.post("/v1/chat/completions", headers=ALICE, json={"model": "gpt-9", "messages": QUESTION})
        assert unknown.status_code == 404
        error = unknown.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-9" in error["message"]
        no_messages = await client.post("/v1/chat/completions", headers=ALICE, json={"model": "auto", "messages": []})
        assert no_messages.status_code == 400 and no_messages.json()["error"]["type"] == "invalid_request_error"
        unauthorised = await client.post("/v1/chat/completions", json={"model": "auto", "messages": QUESTION})
        assert unauthorised.status_code == 401 and "error" in unauthorised.json()


def sdk(product_stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{product_stack.url}/v1", api_key="key-alice", max_retries=0, timeout=120)


async def test_the_openai_sdk_lists_and_retrieves_the_served_model(product_stack):
    client = sdk(product_stack)
    listed = (await client.models.list()).data[0]
    retrieved = await client.models.retrieve(listed.id)
    assert (retrieved.id, retrieved.created, retrieved.object) == (listed.id, listed.created, "model")
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-9")


async def test_the_openai_sdk_completes_with_developer_role_fingerprint_and_cached_tokens(product_stack):
    client = sdk(product_stack)
    model = (await client.models.list()).data[0].id
    messages = [{"role": "developer", "content": "Answer in one word."}, *QUESTION]
    first = await client.chat.completions.create(model=model, messages=messages, temperature=0, max_completion_tokens=8)
    again = await client.chat.completions.create(model=model, messages=messages, temperature=0, max_completion_tokens=8)
    assert "Paris" in (first.choices[0].message.content or "")
    assert first.choices[0].finish_reason in ("stop", "length") and first.system_fingerprint
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    # The second asks the same prompt: its full blocks come from the prefix cache.
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


async def test_the_openai_sdk_streams_the_same_text_with_usage(product_stack):
    client = sdk(product_stack)
    model = (await client.models.list()).data[0].id
    request = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 12}
    whole = await client.chat.completions.create(**request)
    stream = await client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens >= 0


async def test_top_k_or_min_p_of_one_is_greedy_and_a_stop_token_id_ends_the_reply(product_stack):
    client = sdk(product_stack)
    model = (await client.models.list()).data[0].id
    greedy = await client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8)
    top_one = await client.chat.completions.create(
        model=model, messages=QUESTION, temperature=1.5, seed=5, max_tokens=8, extra_body={"top_k": 1}
    )
    assert top_one.choices[0].message.content == greedy.choices[0].message.content
    min_p_one = await client.chat.completions.create(
        model=model, messages=QUESTION, temperature=1.5, seed=5, max_tokens=8, extra_body={"min_p": 1.0}
    )
    assert min_p_one.choices[0].message.content == greedy.choices[0].message.content
    hot = await client.chat.completions.create(model=model, messages=QUESTION, temperature=1.5, seed=5, max_tokens=8)
    assert hot.choices[0].message.content != greedy.choices[0].message.content  # the two above are not greedy by chance
    # The greedy reply's first token, as a stop token: the reply ends at once, with "stop".
    first_token = load_tokenizer(None).encode(greedy.choices[0].message.content or "")[0]
    cut = await client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=8, extra_body={"stop_token_ids": [first_token]}
    )
    assert cut.choices[0].finish_reason == "stop" and cut.usage is not None and cut.usage.completion_tokens == 1
    assert greedy.usage is not None and greedy.usage.completion_tokens > 1


async def test_unsupported_parameters_are_refused_by_name_through_the_sdk(product_stack):
    client = sdk(product_stack)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="auto", messages=QUESTION, n=9)
    assert refused.value.status_code == 400 and refused.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="auto", messages=QUESTION, max_tokens=4, max_completion_tokens=5)
    assert refused.value.body["param"] == "max_completion_tokens"
    accepted = await client.chat.completions.create(model="auto", messages=QUESTION, max_tokens=2, n=1, user="someone", presence_penalty=0)
    assert accepted.usage is not None and accepted.usage.completion_tokens <= 2


async def test_max_model_len_max_completion_tokens_user_parallel_tool_calls_and_usage_chunk_through_the_sdk(product_stack):
    client = sdk(product_stack)
    listed = (await client.models.list()).data[0]
    retrieved = await client.models.retrieve(listed.id)
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=30) as http:
        window = (await http.post("/tokenize", headers=ALICE, json={"model": listed.id, "prompt": "x"})).json()["max_model_len"]
    assert (listed.model_extra or {})["max_model_len"] == (retrieved.model_extra or {})["max_model_len"] == window > 0
    # max_completion_tokens caps the reply as max_tokens does; user and parallel_tool_calls are accepted, not "unknown".
    request = {"model": listed.id, "messages": QUESTION, "temperature": 0, "extra_body": {"ignore_eos": True}}
    raw = await client.chat.completions.with_raw_response.create(
        **request, max_completion_tokens=3, user="end-user-7", parallel_tool_calls=True
    )
    capped = raw.parse()
    assert "x-tandem-ignored-fields" not in raw.headers
    assert capped.usage is not None and capped.usage.completion_tokens == 3 and capped.choices[0].finish_reason == "length"
    # Without stream_options no chunk is a usage chunk; with include_usage the last one is, and has no choices.
    plain = [chunk async for chunk in await client.chat.completions.create(**request, max_tokens=3, stream=True)]
    assert all(chunk.choices and chunk.usage is None for chunk in plain)
    counted = [
        chunk
        async for chunk in await client.chat.completions.create(
            **request, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    ]
    assert counted[-1].choices == [] and counted[-1].usage is not None and counted[-1].usage.completion_tokens == 3
    assert all(chunk.usage is None for chunk in counted[:-1])


async def test_n_choices_have_their_own_seed_streams_count_the_prompt_once_and_share_its_full_blocks(product_stack):
    client = sdk(product_stack)
    # A prompt no other test sends, two blocks and more: choices 1 and 2 can find its full blocks
    # cached only because choice 0 computed them. Fixed, with fixed seeds, so the output safety
    # check (a classifier of the sampled text) sees the same text every run.
    codes = random.Random(52)
    words = " ".join(f"{codes.getrandbits(128):032x}" for _ in range(12))
    messages = [{"role": "user", "content": f"Continue this list of codes with a story: {words}"}]
    request = {"model": "auto", "messages": messages, "temperature": 1.0, "max_tokens": 10, "seed": 11, "extra_body": {"ignore_eos": True}}
    whole = await client.chat.completions.create(**request, n=3)
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    texts = [choice.message.content for choice in whole.choices]
    assert len(set(texts)) == 3 and all(choice.finish_reason == "length" for choice in whole.choices)
    usage = whole.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.completion_tokens == 30 and usage.total_tokens == usage.prompt_tokens + 30
    assert (
        usage.prompt_tokens > 2 * BLOCK_SIZE
        and usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    )
    # Choice i samples with seed + i: the same text as one choice asked for with that seed.
    for index in (0, 1):
        alone = await client.chat.completions.create(**{**request, "seed": 11 + index})
        assert alone.choices[0].message.content == texts[index]
        assert alone.usage is not None and alone.usage.prompt_tokens == usage.prompt_tokens
    stream = await client.chat.completions.create(**request, n=3, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30
    unseeded = await client.chat.completions.create(**{**request, "seed": None}, n=2)
    assert unseeded.choices[0].message.content != unseeded.choices[1].message.content
    text = await client.completions.create(model="auto", prompt="Once upon a time", n=2, max_tokens=6, seed=3, temperature=1.0)
    assert [choice.index for choice in text.choices] == [0, 1] and text.choices[0].text != text.choices[1].text
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="auto", messages=QUESTION, n=9)
    assert refused.value.body["param"] == "n"


async def test_unknown_fields_are_ignored_and_named_in_a_header_whole_and_streamed(product_stack):
    """vLLM's bench client's body (content as text parts) plus fields no one defines: answered,
    with the unknown names in `X-Tandem-Ignored-Fields`; a known parameter it cannot honour is
    still a 400."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": " of France?"}]}]
    body = {"model": "auto", "messages": parts, "temperature": 0, "max_tokens": 4, "vendor_hint": {"x": 1}, "frobnicate": True}
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        whole = await client.post("/v1/chat/completions", headers=ALICE, json=body)
        assert whole.status_code == 200, whole.text
        assert whole.headers["x-tandem-ignored-fields"] == "vendor_hint, frobnicate"
        plain = (await client.post("/v1/chat/completions", headers=ALICE, json={**body, "messages": QUESTION})).json()
        assert whole.json()["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        async with client.stream("POST", "/v1/chat/completions", headers=ALICE, json={**body, "stream": True}) as streamed:
            assert streamed.status_code == 200 and streamed.headers["x-tandem-ignored-fields"] == "vendor_hint, frobnicate"
            assert [line async for line in streamed.aiter_lines() if line.startswith("data:")][-1] == "data: [DONE]"
        named = await client.post("/v1/completions", headers=ALICE, json={"model": "auto", "prompt": "Hi", "max_tokens": 2, "x": 1})
        assert named.status_code == 200 and named.headers["x-tandem-ignored-fields"] == "x"
        clean = await client.post("/v1/chat/completions", headers=ALICE, json={"model": "auto", "messages": QUESTION, "max_tokens": 1})
        assert "x-tandem-ignored-fields" not in clean.headers
        refused = await client.post("/v1/chat/completions", headers=ALICE, json={**body, "tools": [{"type": "function"}]})
        assert refused.status_code == 400 and refused.json()["error"]["param"].split(".")[0] == "tools"


async def test_ignore_eos_runs_to_max_tokens_and_min_tokens_holds_the_end_back(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        body = {"model": "auto", "messages": QUESTION, "temperature": 0, "max_tokens": 48}
        plain = (await client.post("/v1/chat/completions", headers=ALICE, json=body)).json()
        num_plain = plain["usage"]["completion_tokens"]
        assert plain["choices"][0]["finish_reason"] == "stop" and num_plain < 40, "the model ends this answer by itself"
        ignored = (await client.post("/v1/chat/completions", headers=ALICE, json={**body, "ignore_eos": True})).json()
        assert ignored["usage"]["completion_tokens"] == 48 and ignored["choices"][0]["finish_reason"] == "length"
        held = (await client.post("/v1/chat/completions", headers=ALICE, json={**body, "min_tokens": num_plain + 4})).json()
        assert held["usage"]["completion_tokens"] >= num_plain + 4
        too_many = await client.post("/v1/chat/completions", headers=ALICE, json={**body, "min_tokens": 49})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "min_tokens"


async def test_penalties_change_the_greedy_text_of_a_repeating_prompt_and_logit_bias_forces_a_token(product_stack):
    client = sdk(product_stack)
    chant = [{"role": "user", "content": "Repeat after me, many times: la la la la la la la la la la la la"}]
    base = {"model": "auto", "messages": chant, "temperature": 0, "max_tokens": 24}
    plain = await client.chat.completions.create(**base)
    for penalties in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        penalised = await client.chat.completions.create(**base, **penalties)
        assert penalised.choices[0].message.content != plain.choices[0].message.content, penalties
    token = load_tokenizer(None).encode(" Paris")[-1]
    forced = await client.chat.completions.create(
        model="auto", messages=QUESTION, temperature=0, max_tokens=4, logit_bias={str(token): 100}, extra_body={"ignore_eos": True}
    )
    assert forced.choices[0].message.content == load_tokenizer(None).decode([token] * 4)


async def test_a_reply_forced_to_repeat_one_token_is_stopped_with_finish_length_and_stop_reason_repetition(product_stack):
    """The workers' repetition stop at its defaults (64 copies of one token: a run that long is no
    text), whole and streamed; a reply asking for every token (ignore_eos) runs on."""
    token = load_tokenizer(None).encode(" Paris")[-1]
    body = {"model": "auto", "messages": QUESTION, "temperature": 0, "max_tokens": 120, "logit_bias": {str(token): 100}}
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        whole = (await client.post("/v1/chat/completions", headers=ALICE, json=body)).json()
        choice = whole["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"], whole["usage"]["completion_tokens"]) == ("length", "repetition", 64)
        assert choice["message"]["content"] == load_tokenizer(None).decode([token] * 64)
        stream_body = {**body, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", headers=ALICE, json=stream_body) as response:
            lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
        last = [json.loads(line.removeprefix("data: "))["choices"][0] for line in lines][-1]
        assert (last["finish_reason"], last["stop_reason"]) == ("length", "repetition")
        every_token = (await client.post("/v1/chat/completions", headers=ALICE, json={**body, "max_tokens": 80, "ignore_eos": True})).json()
        assert (every_token["choices"][0]["stop_reason"], every_token["usage"]["completion_tokens"]) == (None, 80)
        plain = (await client.post("/v1/chat/completions", headers=ALICE, json={**body, "logit_bias": {}, "max_tokens": 16})).json()
        assert plain["choices"][0]["stop_reason"] is None and "Paris" in plain["choices"][0]["message"]["content"]


async def test_tokenize_takes_vllms_bench_body_and_needs_a_key(product_stack):
    """vLLM's `{"model", "prompt", "add_special_tokens"}`; without a key it is a 401, as every
    metered route is."""
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        model = await served_model(client)
        body = {"model": model, "prompt": "Hello world", "add_special_tokens": False}
        counted = await client.post("/tokenize", headers=ALICE, json=body)
        assert counted.status_code == 200 and counted.json()["count"] == len(counted.json()["tokens"]) > 0
        assert (await client.post("/tokenize", json=body)).status_code == 401


async def test_tokenize_counts_what_a_completion_bills_and_detokenize_inverts_it(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        model = await served_model(client)
        counted = await client.post("/tokenize", headers=ALICE, json={"model": model, "messages": QUESTION})
        assert counted.status_code == 200, counted.text
        body = counted.json()
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] > body["count"]
        billed = (
            await client.post("/v1/chat/completions", headers=ALICE, json={"model": model, "messages": QUESTION, "max_tokens": 1})
        ).json()
        assert billed["usage"]["prompt_tokens"] == body["count"]
        text = "The capital of France is Paris."
        ids = (await client.post("/tokenize", headers=ALICE, json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
        back = await client.post("/detokenize", headers=ALICE, json={"model": model, "tokens": ids})
        assert back.status_code == 200 and back.json() == {"prompt": text}
        outside = await client.post("/detokenize", headers=ALICE, json={"tokens": [10**9]})
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
        assert (await client.post("/tokenize", json={"prompt": text})).status_code == 401
        unknown = await client.post("/tokenize", headers=ALICE, json={"model": "gpt-9", "prompt": text})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


async def test_ops_paths_answer_on_the_ops_port_and_are_404_on_the_public_one(product_stack):
    async with httpx.AsyncClient(timeout=30) as client:
        for path in OPS_PATHS:
            public = await client.get(f"{product_stack.url}{path}")
            assert public.status_code == 404, (path, public.status_code)
            ops = await client.get(f"{product_stack.chat_ops_url}{path}")
            assert ops.status_code == 200, (path, ops.status_code)
        version = await client.get(f"{product_stack.chat_ops_url}/version")
        assert version.json()["version"] == tandem.__version__
        paths = (await client.get(f"{product_stack.chat_ops_url}/openapi.json")).json()["paths"]
        assert "/v1/chat/completions" in paths and "/metrics" not in paths, "the schema is the public API's"


async def test_the_public_health_answers_without_a_key_or_redis_while_readyz_reports_redis_down(product_stack):
    """/health reads only the chat's own memory: with Redis frozen it still answers 200, while the
    ops port's /readyz (a Redis ping) says 503."""
    assert product_stack.redis_server is not None
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(f"{product_stack.url}/health")).json() == {"status": "ok"}
        freeze(product_stack.redis_server.pid)
        try:
            health = await client.get(f"{product_stack.url}/health", timeout=5)
            ready = await client.get(f"{product_stack.chat_ops_url}/readyz", timeout=10)
        finally:
            os.kill(product_stack.redis_server.pid, signal.SIGCONT)
    assert health.status_code == 200, health.text
    assert ready.status_code == 503 and ready.json()["checks"]["redis"] is False, ready.text


async def test_the_sdk_completes_a_text_prompt_whole_and_streamed_alike(product_stack):
    client = sdk(product_stack)
    model = (await client.models.list()).data[0].id
    request = {"model": model, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6}
    whole = await client.completions.create(**request)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.system_fingerprint
    assert "Paris" in whole.choices[0].text and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    stream = await client.completions.create(**request, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # The same prompt as token ids (with the BOS a text prompt gets) gives the same text.
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=30) as http:
        ids = (await http.post("/tokenize", headers=ALICE, json={"prompt": request["prompt"]})).json()["tokens"]
    as_ids = await client.completions.create(**{**request, "prompt": ids})
    assert as_ids.choices[0].text == whole.choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=model, prompt="x", echo=True)
    assert refused.value.body["param"] == "echo"


def check_chat_logprobs(content, text: str, num_top: int) -> None:
    """Greedy tokens' logprobs: their texts make the reply's, each is <= 0 and the first (the
    likeliest) of its sorted alternatives; the end-of-sequence token, if listed, has no text."""
    assert content and "".join(entry.token for entry in content) == text
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert len(alternatives) == num_top and alternatives == sorted(alternatives, reverse=True)
        assert entry.logprob == max(alternatives)
        assert entry.token in (entry.top_logprobs[0].token, "")


async def test_the_sdk_gets_chat_logprobs_whole_and_streamed_alike(product_stack):
    client = sdk(product_stack)
    model = (await client.models.list()).data[0].id
    request = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 12, "logprobs": True, "top_logprobs": 3}
    whole = await client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    check_chat_logprobs(choice.logprobs.content, choice.message.content or "", 3)
    stream = await client.chat.completions.create(**request, stream=True)
    streamed = [
        entry async for chunk in stream if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content or []
    ]
    check_chat_logprobs(streamed, choice.message.content or "", 3)
    assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-3)
    plain = await client.chat.completions.create(**{**request, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


async def test_the_sdk_gets_text_completion_logprobs_whole_and_streamed(product_stack):
    client = sdk(product_stack)
    model = (await client.models.list()).data[0].id
    request = {"model": model, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6, "logprobs": 2}
    whole = (await client.completions.create(**request)).choices[0]
    logprobs = whole.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs and logprobs.text_offset
    assert "".join(logprobs.tokens) == whole.text and len(logprobs.tokens) == 6
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(6)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and logprob <= 0 and logprob == max(top.values()) and top[token] == logprob
    stream = await client.completions.create(**request, stream=True)
    chunks = [chunk.choices[0] async for chunk in stream if chunk.choices and chunk.choices[0].logprobs]
    assert [t for c in chunks for t in c.logprobs.tokens] == logprobs.tokens
    assert [o for c in chunks for o in c.logprobs.text_offset] == logprobs.text_offset


async def test_a_cancelled_stream_finishes_with_abort_not_stop(product_stack):
    client = sdk(product_stack)
    model = (await client.models.list()).data[0].id
    long_answer = [{"role": "user", "content": "Write a long story about a dragon."}]
    # Greedy, so the words are known: a sampled story sometimes trips the output check (the
    # stack's profanity model) in the tokens written before the cancel lands, and then ends
    # content_filter, rightly; the greedy one never does in its 200 tokens.
    stream = await client.chat.completions.create(model=model, messages=long_answer, max_tokens=200, temperature=0, stream=True)
    finishes, num_content_chunks = [], 0
    nc = await nats.connect(product_stack.nats_url)
    try:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                num_content_chunks += 1
                if num_content_chunks == 2:  # the reply is running: stop it as the product's stop does
                    await nc.publish(subjects.cancel(chunk.id), encode(Cancel(reply_id=chunk.id, reason="test")))
            if chunk.choices and chunk.choices[0].finish_reason:
                finishes.append(chunk.choices[0].finish_reason)
    finally:
        await nc.close()
    assert finishes == ["abort"] and num_content_chunks < 200


CITY_QUESTION = [{"role": "user", "content": "Describe Paris as JSON: its name, its country and its population in millions."}]
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        "is_capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population_millions", "is_capital"],
    "additionalProperties": False,
}


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)


async def test_every_json_schema_answer_parses_and_validates_greedy_seeded_and_streamed(product_stack):
    client = sdk(product_stack)
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    base = {"model": "auto", "messages": CITY_QUESTION, "max_tokens": 160, "response_format": response_format}
    for options in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}, {"temperature": 1.3, "seed": 3}):
        answer = await client.chat.completions.create(**base, **options)
        assert answer.choices[0].finish_reason == "stop", options
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), CITY_SCHEMA)
    stream = await client.chat.completions.create(**base, temperature=1.0, seed=4, stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    # the text completion takes the same parameter
    completion = await client.completions.create(
        model="auto", prompt="Paris, as JSON:", max_tokens=160, temperature=0, extra_body={"response_format": response_format}
    )
    jsonschema.validate(json.loads(completion.choices[0].text), CITY_SCHEMA)


async def test_the_sdks_parse_fills_a_pydantic_model_and_json_object_and_guided_fields_constrain_the_reply(product_stack):
    client = sdk(product_stack)
    for seed in (1, 2, 3):
        parsed = await client.chat.completions.parse(
            model="auto", messages=CITY_QUESTION, response_format=City, temperature=1.0, seed=seed, max_tokens=160
        )
        assert isinstance(parsed.choices[0].message.parsed, City)
    whole = await client.chat.completions.create(
        model="auto", messages=CITY_QUESTION, response_format={"type": "json_object"}, temperature=0, max_tokens=160
    )
    assert isinstance(json.loads(whole.choices[0].message.content or ""), dict)
    chosen = await client.chat.completions.create(
        model="auto", messages=QUESTION, temperature=1.0, seed=5, max_tokens=16, extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]}
    )
    assert chosen.choices[0].message.content in ("Paris", "Lyon", "Nice")
    dated = await client.chat.completions.create(
        model="auto", messages=QUESTION, temperature=0, max_tokens=16, extra_body={"guided_regex": "[0-9]{4}-[0-9]{2}"}
    )
    assert re.fullmatch("[0-9]{4}-[0-9]{2}", dated.choices[0].message.content or "")


async def test_a_schema_the_grammar_library_refuses_is_a_400_naming_it_and_the_workers_keep_serving(product_stack):
    client = sdk(product_stack)
    lookahead = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)x"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="auto", messages=QUESTION, response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": lookahead}}
        )
    assert refused.value.body["param"] == "response_format" and "look-around" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="auto", messages=QUESTION, extra_body={"guided_regex": "(unclosed"})
    assert refused.value.body["param"] == "guided_regex"
    after = await client.chat.completions.create(model="auto", messages=QUESTION, temperature=0, max_tokens=8)
    assert "Paris" in (after.choices[0].message.content or "")
