"""The OpenAI request bodies: which parameters are honoured, which are refused by name, and the
sampling parameters they ask of the engine."""

import json

import pytest
from pydantic import ValidationError

from services.chat.completions_api import TextCompletionBody
from services.chat.config import AnswerLength
from services.chat.errors import InvalidRequest
from services.chat.openai_schemas import ChatCompletionBody, openai_finish_reason
from tandem.v1.common_pb2 import FINISH_REASON_CANCELLED, FINISH_REASON_CONTENT_FILTER, FINISH_REASON_LENGTH, FINISH_REASON_STOP

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"model": "m", "messages": MESSAGES, **fields})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("best_of", 2),
        ("guided_grammar", "root ::= 'a'"),
        ("structured_outputs", {"json": {"type": "object"}}),
        ("suffix", "end"),
    ],
)
def test_an_unsupported_parameter_is_refused_by_name(field, value):
    with pytest.raises(InvalidRequest) as refused:
        chat(**{field: value}).refuse_unsupported()
    assert refused.value.param == field and refused.value.code == "unsupported_parameter"
    assert f"`{field}`" in refused.value.message


def test_unknown_fields_are_accepted_and_listed_as_ignored_in_the_order_sent():
    body = chat(frobnicate=1, user="u1", n=1, vendor_hint={"a": 1}, chat_template_kwargs=None)
    body.refuse_unsupported()
    assert body.ignored_fields() == ["frobnicate", "vendor_hint", "chat_template_kwargs"]
    assert chat(n=1, user="u1").ignored_fields() == []


def test_content_as_a_list_of_text_parts_is_joined_as_vllms_bench_client_sends_it():
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}])
    assert body.messages[0].as_template_message() == {"role": "user", "content": "Hello, world"}


def test_stream_options_without_stream_are_refused_as_openai_does():
    with pytest.raises(InvalidRequest) as refused:
        chat(stream_options={"include_usage": True}).refuse_unsupported()
    assert refused.value.param == "stream_options"
    chat(stream=True, stream_options={"include_usage": True}).refuse_unsupported()


def test_neutral_values_nulls_and_user_are_accepted():
    chat(
        n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False, tools=None, response_format={"type": "text"}, user="u1"
    ).refuse_unsupported()


@pytest.mark.parametrize("value", [True, False])
def test_parallel_tool_calls_is_accepted_either_way_while_tools_are_absent_and_not_listed_as_unknown(value):
    body = chat(parallel_tool_calls=value, user="end-user-7")
    body.refuse_unsupported()
    assert body.ignored_fields() == [] and body.user == "end-user-7"


def test_sampling_carries_top_k_stop_token_ids_seed_and_stops():
    params = chat(temperature=0.5, top_p=0.9, top_k=40, min_p=0.1, stop_token_ids=[7, 9], seed=3, stop=["x", ""], max_tokens=10).sampling(
        AnswerLength(48), 100
    )
    assert (params.top_k, list(params.stop_token_ids), params.seed, list(params.stop), params.max_tokens) == (40, [7, 9], 3, ["x"], 10)
    assert params.temperature == pytest.approx(0.5) and params.top_p == pytest.approx(0.9) and params.min_p == pytest.approx(0.1)


def test_defaults_are_openais_and_max_tokens_fits_the_window():
    params = chat(top_k=-1).sampling(AnswerLength(48), 20)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.HasField("seed")) == (1.0, 1.0, 0, 20, False)


def test_ignore_eos_and_min_tokens_reach_the_engine_and_null_is_not_sent():
    params = chat(ignore_eos=True, min_tokens=4, max_tokens=10).sampling(AnswerLength(48), 100)
    assert (params.ignore_eos, params.min_tokens, params.max_tokens) == (True, 4, 10)
    assert (
        chat(ignore_eos=None, min_tokens=None).sampling(AnswerLength(48), 100).min_tokens,
        chat().sampling(AnswerLength(48), 100).ignore_eos,
    ) == (0, False)


def test_penalties_and_logit_bias_reach_the_engine_with_string_token_ids_read_as_ids():
    params = chat(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, logit_bias={"5": 100, "17": -2.5}).sampling(
        AnswerLength(48), 100
    )
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert params.repetition_penalty == pytest.approx(1.2) and dict(params.logit_bias) == {5: 100.0, 17: -2.5}
    off = chat(presence_penalty=None, repetition_penalty=None, logit_bias=None).sampling(AnswerLength(48), 100)
    assert (off.presence_penalty, off.frequency_penalty, off.repetition_penalty, dict(off.logit_bias)) == (0.0, 0.0, 1.0, {})


def test_min_tokens_above_max_tokens_is_refused_and_the_window_caps_both():
    with pytest.raises(InvalidRequest) as refused:
        chat(min_tokens=11, max_completion_tokens=10).sampling(AnswerLength(48), 100)
    assert refused.value.param == "min_tokens"
    assert chat(min_tokens=5, max_tokens=5).sampling(AnswerLength(48), 100).min_tokens == 5
    params = chat(min_tokens=30, max_tokens=40).sampling(AnswerLength(48), 20)
    assert (params.min_tokens, params.max_tokens) == (20, 20)
    assert chat(min_tokens=60).sampling(AnswerLength(48), 100).min_tokens == 48, "no max_tokens: capped at the default answer length"


def test_a_tier_cap_lowers_the_max_tokens_asked_and_is_the_default():
    capped = AnswerLength(48, cap_tokens=30)
    assert chat(max_tokens=100).sampling(capped, 1000).max_tokens == 30
    assert chat(max_tokens=10).sampling(capped, 1000).max_tokens == 10, "a smaller max_tokens asked for stands"
    assert chat().sampling(AnswerLength(30, cap_tokens=30), 1000).max_tokens == 30
    assert chat(max_tokens=100).sampling(capped, 20).max_tokens == 20, "the window's room caps it too"
    assert chat(max_tokens=100).sampling(AnswerLength(48), 1000).max_tokens == 100, "no cap: what was asked, as before"


def test_max_completion_tokens_is_max_tokens_and_they_must_agree():
    assert chat(max_completion_tokens=5).sampling(AnswerLength(48), 100).max_tokens == 5
    assert chat(max_completion_tokens=5, max_tokens=5).sampling(AnswerLength(48), 100).max_tokens == 5
    with pytest.raises(InvalidRequest) as refused:
        chat(max_completion_tokens=5, max_tokens=6).sampling(AnswerLength(48), 100)
    assert refused.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 201}, "stop"),
        ({"stop": ["ok", "x" * 201]}, "stop"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**32}, "max_tokens"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 2**32}, "top_k"),
        ({"min_p": float("inf")}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2**32}, "min_tokens"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"word": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"stop_token_ids": [2**32]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"messages": MESSAGES * 1001}, "messages"),
        ({"model": "m" * 201}, "model"),
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),
        ({"n": True}, "n"),
    ],
)
def test_a_value_outside_its_bounds_is_refused_by_validation_naming_it(fields, param):
    with pytest.raises(ValidationError) as refused:
        chat(**fields)
    assert refused.value.errors()[0]["loc"][0] == param


def test_values_at_their_bounds_fit_the_engines_sampling_params():
    """The largest accepted values go into the protobuf without a range error."""
    body = chat(
        seed=2**64 - 1, max_tokens=1 << 20, temperature=2, top_p=1, top_k=2**31 - 1, stop_token_ids=[2**32 - 1], stop=["x" * 200] * 4
    )
    params = body.sampling(AnswerLength(48), 100)
    assert (params.seed, params.max_tokens, params.top_k, list(params.stop_token_ids)) == (2**64 - 1, 100, 2**31 - 1, [2**32 - 1])


@pytest.mark.parametrize(("field", "value"), [("top_logprobs", 2), ("tool_choice", "auto")])
def test_top_logprobs_without_logprobs_and_other_values_than_the_neutral_one_are_refused(field, value):
    """`top_logprobs` without `logprobs: true` is refused, as OpenAI does."""
    with pytest.raises(InvalidRequest) as refused:
        chat(**{field: value}).refuse_unsupported()
    assert refused.value.param == field


def test_the_developer_role_reaches_the_template_as_system():
    body = chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}, *MESSAGES])
    assert body.messages[0].as_template_message() == {"role": "system", "content": "be brief"}


def test_a_message_field_that_would_be_dropped_is_refused():
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "assistant", "content": "", "audio": {"id": "a1"}}])


def test_a_cancelled_reply_finishes_with_abort_not_stop():
    assert [openai_finish_reason(f) for f in (FINISH_REASON_STOP, FINISH_REASON_LENGTH, FINISH_REASON_CANCELLED)] == [
        "stop",
        "length",
        "abort",
    ]


def test_a_reply_a_safety_check_ended_finishes_with_content_filter():
    assert openai_finish_reason(FINISH_REASON_CONTENT_FILTER) == "content_filter"


def test_chat_logprobs_ask_the_engine_for_top_logprobs_and_are_off_unless_true():
    assert chat(logprobs=True, top_logprobs=3).sampling(AnswerLength(48), 100).top_logprobs == 3
    assert chat(logprobs=True).sampling(AnswerLength(48), 100).top_logprobs == 0
    for off in (chat(), chat(logprobs=False), chat(logprobs=False, top_logprobs=0)):
        off.refuse_unsupported()
        assert not off.sampling(AnswerLength(48), 100).HasField("top_logprobs")
    with pytest.raises(ValidationError):
        chat(logprobs=True, top_logprobs=21)


def test_a_text_completions_logprobs_is_the_count_and_false_is_off():
    def text(**fields) -> TextCompletionBody:
        return TextCompletionBody.model_validate({"model": "m", "prompt": "hi", **fields})

    assert text(logprobs=2).sampling(AnswerLength(48), 100).top_logprobs == 2
    assert text(logprobs=0).sampling(AnswerLength(48), 100).top_logprobs == 0, "0: the chosen tokens' logprobs alone"
    assert not text(logprobs=False).sampling(AnswerLength(48), 100).HasField("top_logprobs")
    assert not text().sampling(AnswerLength(48), 100).HasField("top_logprobs")
    with pytest.raises(ValidationError):
        text(logprobs=21)
    with pytest.raises(InvalidRequest) as refused:
        text(top_logprobs=2).refuse_unsupported()
    assert refused.value.param == "top_logprobs"


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_response_format_and_guided_fields_become_one_grammar_spec_for_the_engine():
    as_openai = chat(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}})
    assert json.loads(as_openai.sampling(AnswerLength(48), 100).grammar) == {"json_schema": SCHEMA}
    assert json.loads(chat(guided_json=json.dumps(SCHEMA)).sampling(AnswerLength(48), 100).grammar) == {"json_schema": SCHEMA}
    assert json.loads(chat(response_format={"type": "json_object"}).sampling(AnswerLength(48), 100).grammar) == {"json_object": {}}
    assert json.loads(chat(guided_regex="[0-9]+").sampling(AnswerLength(48), 100).grammar) == {"regex": "[0-9]+"}
    assert json.loads(chat(guided_choice=["yes", "no"]).sampling(AnswerLength(48), 100).grammar) == {"choice": ["yes", "no"]}
    assert chat(response_format={"type": "text"}).sampling(AnswerLength(48), 100).grammar == ""


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "frobnicate"}}}},
            "response_format",
            "frobnicate",
        ),
        ({"guided_json": {"type": "string", "pattern": "(?=x)a"}}, "guided_json", "look-around"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs `json_schema`"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one structured output"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_json": {"enum": ["x" * 70_000]}}, "guided_json", "bytes"),
    ],
)
def test_a_grammar_the_library_refuses_is_an_invalid_request_naming_the_problem(fields, param, named):
    with pytest.raises(InvalidRequest) as refused:
        chat(**fields).sampling(AnswerLength(48), 100)
    assert refused.value.param == param and named in refused.value.message
