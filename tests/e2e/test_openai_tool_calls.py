"""Tools on `/v1/chat/completions` through the SDK. The embedded SmolLM2's chat template has no tool
support: offering it tools is a 400 that says so. A stack of its own serves a random-weight
checkpoint whose template (the tests' own, Hermes-style: tests/reference_model.py) offers tools:
a forced call (`tool_choice` naming a function, or "required") comes back as `tool_calls` whose
arguments validate against the function's schema, whole and streamed. Its weights are noise, so
only the forced call's grammar can make the reply a call. (The stack: tests/e2e/conftest.py.)"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.real_model
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "the quick brown fox"}]


def sdk(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="key-alice", max_retries=0, timeout=120)


def checked(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def test_a_template_without_tool_support_is_a_400_that_says_so(lean_stack):
    client = sdk(lean_stack)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="auto", messages=ASK, tools=[WEATHER])
    assert refused.value.body["param"] == "tools" and "chat template has no tool support" in refused.value.body["message"]
    # tool_choice "none": the tools are not shown to the model, so its template need not read them.
    answered = await client.chat.completions.create(model="auto", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=2)
    assert answered.choices[0].message.tool_calls is None and answered.choices[0].message.content


async def test_a_forced_call_is_a_tool_call_whose_arguments_match_the_function_s_schema(tools_stack):
    client = sdk(tools_stack)
    model = (await client.models.list()).data[0].id
    request = {"model": model, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": FORCED, "max_tokens": 200, "temperature": 1.0}
    for seed in range(3):
        answer = await client.chat.completions.create(**request, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        checked(call.function.name, call.function.arguments)
    # Streamed: the call's id and name, then its arguments; the same seed writes the same call.
    chunks = [chunk async for chunk in await client.chat.completions.create(**request, seed=2, stream=True)]
    deltas = [delta for chunk in chunks for delta in chunk.choices[0].delta.tool_calls or []]
    assert deltas and all(delta.index == 0 for delta in deltas)
    assert deltas[0].id and deltas[0].id.startswith("call_") and deltas[0].function and deltas[0].function.name == "get_weather"
    arguments = "".join(delta.function.arguments or "" for delta in deltas if delta.function)
    checked("get_weather", arguments)
    assert json.loads(arguments) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == ""


async def test_a_required_call_after_a_tool_turn_is_one_of_the_tools(tools_stack):
    """A conversation that carries an earlier call and its result back is rendered and answered."""
    client = sdk(tools_stack)
    model = (await client.models.list()).data[0].id
    earlier = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [earlier]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    answer = await client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200, seed=5, temperature=1.0
    )
    [call] = answer.choices[0].message.tool_calls or []
    assert answer.choices[0].finish_reason == "tool_calls"
    checked(call.function.name, call.function.arguments)
    # "auto": free text, read for calls; the noise model writes none, so it is all content.
    free = await client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=8, seed=5)
    assert free.choices[0].finish_reason in ("stop", "length") and free.choices[0].message.tool_calls is None
