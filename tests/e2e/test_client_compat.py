"""The compatibility suite: the clients teams put in front of an OpenAI-compatible server, used
unchanged against the running stack: the `openai` SDK's synchronous client (the async one is
tests/e2e/test_openai_api.py's), LangChain's `ChatOpenAI` (plain, streamed, `with_structured_output`,
`bind_tools`), LiteLLM's `completion` with the `openai/` prefix, and the request bodies Open WebUI and
LibreChat send for a chat turn, a title and a follow-up (tests/e2e/client_bodies.py), replayed as
they are. The tool calls run on the stack whose model's template offers tools (conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from client_bodies import (
    librechat_title,
    librechat_turn,
    open_webui_follow_ups,
    open_webui_tags,
    open_webui_title,
    open_webui_turn,
)
from product_stack import ALICE
from pydantic import BaseModel, Field

pytestmark = pytest.mark.real_model
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY = ALICE["Authorization"].removeprefix("Bearer ")


class Capital(BaseModel):
    country: str = Field(max_length=24)
    city: str = Field(max_length=24)


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city", "parameters": WEATHER_SCHEMA}}


async def test_the_sdks_synchronous_client_completes_streams_and_parses(product_stack):
    client = openai.OpenAI(base_url=f"{product_stack.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def use() -> tuple[Any, str, Any]:
        whole = client.chat.completions.create(model="auto", messages=QUESTION, temperature=0, max_tokens=16)
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(model="auto", messages=QUESTION, temperature=0, max_tokens=16, stream=True)
            if chunk.choices
        )
        parsed = client.chat.completions.parse(model="auto", messages=QUESTION, response_format=Capital, temperature=0, max_tokens=80)
        return whole, streamed, parsed

    whole, streamed, parsed = await asyncio.to_thread(use)
    assert "Paris" in (whole.choices[0].message.content or "") and streamed == whole.choices[0].message.content
    assert isinstance(parsed.choices[0].message.parsed, Capital)


def chat_openai(stack: Any, **options: Any) -> Any:
    from langchain_openai import ChatOpenAI  # imported by the tests that use it: it takes seconds

    return ChatOpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0, timeout=120, **options)


async def test_langchain_invokes_streams_and_fills_a_structured_output(product_stack):
    llm = chat_openai(product_stack, model="auto", temperature=0, max_tokens=16)
    answer = await llm.ainvoke("What is the capital of France?")
    assert "Paris" in answer.content
    assert answer.usage_metadata and answer.usage_metadata["output_tokens"] > 0
    # Streamed with the usage chunk (stream_options.include_usage: LangChain asks for it by default
    # from OpenAI itself only, so a user of another server says so).
    chunks = [chunk async for chunk in llm.astream("What is the capital of France?", stream_usage=True)]
    assert "".join(chunk.content for chunk in chunks) == answer.content
    assert sum((chunk.usage_metadata or {}).get("output_tokens", 0) for chunk in chunks) == answer.usage_metadata["output_tokens"]
    # with_structured_output: a json_schema response_format, parsed into the model, on every seed.
    for seed in (1, 2):
        structured = chat_openai(product_stack, model="auto", temperature=1.0, seed=seed, max_tokens=200).with_structured_output(Capital)
        assert isinstance(await structured.ainvoke("Name a country and its capital."), Capital)
    # ... and the older JSON mode, as a dict.
    as_json = chat_openai(product_stack, model="auto", temperature=0, max_tokens=160).with_structured_output(method="json_mode")
    assert isinstance(await as_json.ainvoke("Describe Paris as JSON: its name, its country and its population in millions."), dict)


async def test_langchain_bind_tools_gets_a_tool_call_it_parses(tools_stack):
    llm = chat_openai(tools_stack, model="auto", temperature=1.0, max_tokens=200, seed=4)
    for choice in ("get_weather", "any"):  # a named function, and LangChain's "any" (sent as "required")
        message = await llm.bind_tools([WEATHER], tool_choice=choice).ainvoke("the quick brown fox")
        [call] = message.tool_calls
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        jsonschema.validate(call["args"], WEATHER_SCHEMA)
    # Streamed: LangChain joins the tool-call chunks into the same call.
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    joined = None
    async for chunk in bound.astream("the quick brown fox"):
        joined = chunk if joined is None else joined + chunk
    assert joined is not None
    [streamed] = joined.tool_calls
    assert streamed["name"] == "get_weather" and streamed["args"] == call["args"]


async def test_litellm_completes_with_the_openai_prefix_whole_streamed_and_async(product_stack):
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # its price list, read from the package, not fetched
    import litellm

    target = {
        "model": "openai/auto",
        "api_base": f"{product_stack.url}/v1",
        "api_key": KEY,
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 16,
    }
    whole = await asyncio.to_thread(litellm.completion, **target)
    text = whole.choices[0].message.content
    assert "Paris" in text and whole.usage.completion_tokens > 0

    def streamed() -> str:
        return "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(**target, stream=True) if chunk.choices)

    assert await asyncio.to_thread(streamed) == text
    again = await litellm.acompletion(**target)
    assert again.choices[0].message.content == text


async def replay(stack: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Posts `body` as it is and reads the answer as a client does: a streamed one event by event,
    split on blank lines as simple clients split them (OpenAI's and vLLM's servers end lines in
    "\n"), each chunk checked for OpenAI's shape, up to `[DONE]`; returns the answer as a whole one
    (`choices[0].message.content`, `finish_reason`, `usage` where sent)."""
    async with httpx.AsyncClient(base_url=stack.url, timeout=120, headers=ALICE) as client:
        if not body.get("stream"):
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert "x-tandem-ignored-fields" not in response.headers
            return response.json()
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            assert "x-tandem-ignored-fields" not in response.headers
            raw = await response.aread()
    assert b"\r" not in raw
    text, finish, usage = "", None, None
    *events, rest = raw.decode().split("\n\n")
    assert rest == "" and events[-1] == "data: [DONE]"
    for event in events[:-1]:
        if event.startswith(":"):  # a keep-alive
            continue
        chunk = json.loads(event.removeprefix("data: "))
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"]
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            assert choice["index"] == 0
            text += choice["delta"].get("content") or ""
            finish = choice.get("finish_reason") or finish
    return {"choices": [{"message": {"content": text}, "finish_reason": finish}], "usage": usage}


def answered(reply: dict) -> bool:
    """A sampled reply on the product stack, answered: with text, or withdrawn by the stack's output
    check (temperature 1 can sample words profanity-check scores as profane: the check's call, not
    the client's body's)."""
    choice = reply["choices"][0]
    return (bool(choice["message"]["content"]) and choice["finish_reason"] in ("stop", "length")) or choice[
        "finish_reason"
    ] == "content_filter"


async def test_open_webui_s_chat_turn_title_follow_ups_and_tags_are_answered_as_sent(product_stack, tools_stack):
    # Legacy function calling: no tools; the chat turn and the background tasks on SmolLM2. None
    # sends a temperature: OpenAI's default, 1, samples, so the text is whatever it is.
    turn = await replay(product_stack, open_webui_turn("auto", native_tools=False))
    assert answered(turn), turn
    for task in (open_webui_title, open_webui_follow_ups, open_webui_tags):
        answer = await replay(product_stack, task("auto"))
        assert answered(answer), answer
        assert answer["usage"]["completion_tokens"] > 0
    # Native function calling (Open WebUI's default) sends its built-in tools with every turn: a
    # model whose template offers tools reads them, and without a call the reply is text.
    native = await replay(tools_stack, open_webui_turn("auto", native_tools=True))
    assert native["choices"][0]["message"]["content"] and native["choices"][0]["finish_reason"] in ("stop", "length")
    # SmolLM2's template has none: the 400 says so, naming the field, which the front-end shows.
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120, headers=ALICE) as client:
        refused = await client.post("/v1/chat/completions", json=open_webui_turn("auto", native_tools=True))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


async def test_librechat_s_turns_and_title_are_answered_as_sent_with_the_usage_chunk(product_stack):
    first = await replay(product_stack, librechat_turn("auto"))
    assert first["choices"][0]["message"]["content"]
    assert (
        first["usage"]["completion_tokens"] > 0
        and first["usage"]["total_tokens"] == first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    )
    older = await replay(product_stack, librechat_turn("auto", older=True))
    assert older["choices"][0]["message"]["content"] and older["usage"]["completion_tokens"] > 0
    follow_up = await replay(product_stack, librechat_turn("auto", follow_up=True))
    assert follow_up["choices"][0]["message"]["content"] and follow_up["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    title = await replay(product_stack, librechat_title("auto"))
    assert answered(title), title
