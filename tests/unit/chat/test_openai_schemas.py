"""The OpenAI request bodies: which parameters are honoured, which are refused by name, and the
sampling parameters they ask of the engine."""

import pytest
from pydantic import ValidationError

from services.chat.errors import InvalidRequest
from services.chat.openai_schemas import ChatCompletionBody, openai_finish_reason
from tandem.v1.common_pb2 import FINISH_REASON_CANCELLED, FINISH_REASON_CONTENT_FILTER, FINISH_REASON_LENGTH, FINISH_REASON_STOP

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"model": "m", "messages": MESSAGES, **fields})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("logprobs", True),
        ("n", 2),
        ("presence_penalty", 0.5),
        ("response_format", {"type": "json_object"}),
        ("frobnicate", 1),
    ],
)
def test_an_unsupported_parameter_is_refused_by_name(field, value):
    with pytest.raises(InvalidRequest) as refused:
        chat(**{field: value}).refuse_unsupported()
    assert refused.value.param == field and refused.value.code == "unsupported_parameter"
    assert f"`{field}`" in refused.value.message


def test_stream_options_without_stream_are_refused_as_openai_does():
    with pytest.raises(InvalidRequest) as refused:
        chat(stream_options={"include_usage": True}).refuse_unsupported()
    assert refused.value.param == "stream_options"
    chat(stream=True, stream_options={"include_usage": True}).refuse_unsupported()


def test_neutral_values_nulls_and_user_are_accepted():
    chat(
        n=1, presence_penalty=0, frequency_penalty=0.0, logprobs=False, tools=None, response_format={"type": "text"}, user="u1"
    ).refuse_unsupported()


def test_sampling_carries_top_k_stop_token_ids_seed_and_stops():
    params = chat(temperature=0.5, top_p=0.9, top_k=40, min_p=0.1, stop_token_ids=[7, 9], seed=3, stop=["x", ""], max_tokens=10).sampling(
        48, 100
    )
    assert (params.top_k, list(params.stop_token_ids), params.seed, list(params.stop), params.max_tokens) == (40, [7, 9], 3, ["x"], 10)
    assert params.temperature == pytest.approx(0.5) and params.top_p == pytest.approx(0.9) and params.min_p == pytest.approx(0.1)


def test_defaults_are_openais_and_max_tokens_fits_the_window():
    params = chat(top_k=-1).sampling(48, 20)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.HasField("seed")) == (1.0, 1.0, 0, 20, False)


def test_max_completion_tokens_is_max_tokens_and_they_must_agree():
    assert chat(max_completion_tokens=5).sampling(48, 100).max_tokens == 5
    assert chat(max_completion_tokens=5, max_tokens=5).sampling(48, 100).max_tokens == 5
    with pytest.raises(InvalidRequest) as refused:
        chat(max_completion_tokens=5, max_tokens=6).sampling(48, 100)
    assert refused.value.param == "max_completion_tokens"


def test_more_than_four_stop_strings_are_refused():
    with pytest.raises(InvalidRequest):
        chat(stop=["a", "b", "c", "d", "e"]).sampling(48, 100)


def test_the_developer_role_reaches_the_template_as_system():
    body = chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}, *MESSAGES])
    assert body.messages[0].as_template_message() == {"role": "system", "content": "be brief"}


def test_a_message_field_that_would_be_dropped_is_refused():
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "assistant", "content": "", "tool_calls": []}])


def test_a_cancelled_reply_finishes_with_abort_not_stop():
    assert [openai_finish_reason(f) for f in (FINISH_REASON_STOP, FINISH_REASON_LENGTH, FINISH_REASON_CANCELLED)] == [
        "stop",
        "length",
        "abort",
    ]


def test_a_reply_a_safety_check_ended_finishes_with_content_filter():
    assert openai_finish_reason(FINISH_REASON_CONTENT_FILTER) == "content_filter"
