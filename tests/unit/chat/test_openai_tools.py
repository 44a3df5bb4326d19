"""Tool calls read out of a reply's text (Hermes' `<tool_call>` blocks and Llama 3's bare JSON),
whole and as it streams, and the request fields that offer and force them."""

from __future__ import annotations

import json

import pytest

from services.chat.errors import InvalidRequest
from services.chat.openai_schemas import ChatCompletionBody
from services.chat.openai_tools import HERMES, JSON, ToolCallStream, forced_call_spec, parse_tool_calls
from tandem import structured_output

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def named(calls: list[dict]) -> list[tuple[str, dict]]:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 10
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls]


def test_a_hermes_call_is_read_and_the_text_around_it_is_the_content():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "Let me look."
    assert named(calls) == [("get_weather", {"city": "Paris"})]


def test_several_hermes_calls_come_in_order_with_distinct_ids():
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text, HERMES)
    assert content is None
    assert named(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}}',  # never closed
    ],
)
def test_a_malformed_call_is_left_in_the_content(block):
    text = f"Before {block} after"
    assert parse_tool_calls(text, HERMES) == (text, [])


def test_a_malformed_block_beside_a_good_one_stays_in_the_content():
    text = '<tool_call>oops</tool_call> and <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "<tool_call>oops</tool_call> and"
    assert named(calls) == [("get_time", {})]


def test_a_llama3_json_reply_is_a_call_and_a_list_is_several():
    content, calls = parse_tool_calls(' {"name": "get_weather", "parameters": {"city": "Oslo"}}\n', JSON)
    assert content is None and named(calls) == [("get_weather", {"city": "Oslo"})]
    content, calls = parse_tool_calls(
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "arguments": {"city": "Bern"}}]', JSON
    )
    assert content is None and named(calls) == [("get_time", {}), ("get_weather", {"city": "Bern"})]


@pytest.mark.parametrize(
    "text", ["The weather is fine.", '{"city": "Oslo"}', 'Here: {"name": "get_time", "parameters": {}}', '{"name": "f", "parameters": 3}']
)
def test_text_that_is_not_a_whole_json_call_is_content(text):
    assert parse_tool_calls(text, JSON) == (text, [])


def streamed(style: str, pieces: list[str]) -> tuple[str, list[dict]]:
    stream = ToolCallStream(style)
    sent = "".join(stream.feed(piece) for piece in pieces)
    rest, calls = stream.finish()
    return sent + rest, calls


def test_a_stream_sends_content_until_a_call_begins_and_the_calls_at_its_end():
    reply = 'Checking the <weather>.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    stream = ToolCallStream(HERMES)
    sent = [stream.feed(reply[i : i + 3]) for i in range(0, len(reply), 3)]
    assert "".join(sent) == "Checking the <weather>.\n", "content up to the call, none of the call"
    rest, calls = stream.finish()
    assert rest == "" and named(calls) == [("get_weather", {"city": "Paris"})]


def test_a_stream_whose_held_tag_prefix_is_not_a_call_sends_it_all():
    assert streamed(HERMES, ["a <tool", "_ca", "t> b"]) == ("a <tool_cat> b", [])
    assert streamed(HERMES, ["ends on <tool_c"]) == ("ends on <tool_c", [])
    text = "x <tool_call>{broken</tool_call> y"
    assert streamed(HERMES, [text[:5], text[5:]]) == (text, [])


def test_a_json_stream_holds_a_reply_that_opens_an_object():
    content, calls = streamed(JSON, [" ", '{"name": "get_time", ', '"parameters": {}}'])
    assert content == "" and named(calls) == [("get_time", {})]
    assert streamed(JSON, [" Hi", " there"]) == (" Hi there", [])
    assert streamed(JSON, ["{not", " a call"]) == ("{not a call", [])


@pytest.mark.parametrize("style", [HERMES, JSON])
@pytest.mark.parametrize("name", ["get_weather", None])
def test_a_forced_call_spec_compiles(style, name):
    spec = forced_call_spec([WEATHER, TIME], name, style)
    structured_output.check_spec(spec)
    if style == HERMES:
        assert "<tool_call>" in json.loads(spec)["lark"]


def body(**fields) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_tools_are_shown_to_the_template_unless_tool_choice_is_none():
    assert body(tools=[WEATHER]).template_tools() == [WEATHER]
    assert body(tools=[WEATHER], tool_choice="none").template_tools() is None
    assert body().template_tools() is None


def test_a_forced_call_is_the_reply_s_grammar_and_auto_is_none():
    forced = body(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    forced.refuse_unsupported()
    forced.use_tool_style(HERMES)
    assert forced.grammar_spec() == forced_call_spec([WEATHER, TIME], "get_time", HERMES)
    assert body(tools=[WEATHER], tool_choice="auto").grammar_spec() == ""
    assert body(tools=[WEATHER], tool_choice="required").grammar_spec() == forced_call_spec([WEATHER], None, JSON)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
    ],
)
def test_a_tool_choice_tools_cannot_meet_is_refused(fields, param):
    with pytest.raises(InvalidRequest) as refused:
        body(**fields).refuse_unsupported()
    assert refused.value.param == param


def test_a_forced_call_and_a_response_format_together_are_refused():
    both = body(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(InvalidRequest, match="cannot be combined"):
        both.grammar_spec()


def test_tool_messages_and_assistant_calls_reach_the_template():
    request = body(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    messages = [m.as_template_message() for m in request.messages]
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "content": "sunny"},  # answers no call
        {"role": "user", "content": "hi", "tool_call_id": "call_1"},
        {"role": "user", "content": None},
        {"role": "user", "content": "x", "tool_calls": []},
    ],
)
def test_tool_fields_on_the_wrong_message_are_refused(message):
    with pytest.raises(ValueError):
        body(messages=[message])
