"""Checkpoint chat templates render as transformers renders them, inside jinja2's sandbox."""

from __future__ import annotations

import pytest
from reference_model import TOOLS_TEMPLATE

from tandem.models.chat_template import ChatTemplate, ChatTemplateError

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Laid out over lines as template authors do: transformers' trim_blocks and lstrip_blocks make the
# block tags' own lines vanish.
MULTILINE = """{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {% endif %}
{{ message['role'] }}: {{ message['content'] }}
{% endfor %}
{% if tools %}{{ tools | tojson }}{% endif %}"""


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source=source, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def test_llama3_template_renders_with_bos_and_generation_prompt():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "}]
    assert template(LLAMA3).render(messages) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert template(LLAMA3).render(messages, add_generation_prompt=False).endswith("hi<|eot_id|>")


def test_block_tags_do_not_leave_their_whitespace():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert template(MULTILINE).render(messages) == "user: hi\nassistant: hello\n"


def test_tojson_keeps_non_ascii_text():
    rendered = template(MULTILINE).render([], tools=[{"name": "météo"}])
    assert rendered.endswith('[{"name": "météo"}]')


def test_raise_exception_refuses_the_conversation():
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        template(MULTILINE).render([{"role": "tool", "content": "x"}])


def test_templates_cannot_reach_python_internals():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        template(escape).render([])
    with pytest.raises(ChatTemplateError):  # immutable: a template cannot change its inputs
        template("{{ messages.append(1) }}").render([])


def test_a_broken_template_is_reported_as_such():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        template("{% for m in messages %}").render([])


def test_tool_support_is_whether_the_template_reads_tools():
    assert template(MULTILINE).supports_tools
    assert template(TOOLS_TEMPLATE).supports_tools
    assert not template(LLAMA3).supports_tools
    assert not template("{% set tools = [] %}{{ tools }}").supports_tools, "a variable it sets itself is not the caller's"


def test_the_call_style_follows_the_template():
    assert template(TOOLS_TEMPLATE).tool_call_style == "hermes"
    assert template(MULTILINE).tool_call_style == "json"


def test_tools_and_tool_turns_are_rendered():
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    messages = [
        {"role": "user", "content": "What time is it?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    text = template(TOOLS_TEMPLATE).render(messages, tools=tools)
    assert '{"name": "get_time", "parameters": {"type": "object", "properties": {}}}' in text
    assert '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' in text
    assert "<|im_start|>tool\nc1: noon<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert "Functions" not in template(TOOLS_TEMPLATE).render(messages[:1])
