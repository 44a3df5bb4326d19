"""The product API's request bodies: every sampling value is bounded by validation, so one the
engine's SamplingParams cannot hold is refused before a turn is stored."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.chat.schemas import MessageBody, NewConversationBody, RegenerateBody


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**32}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": float("inf")}, "top_p"),
        ({"model": "m" * 201}, "model"),
    ],
)
def test_a_sampling_value_outside_its_bounds_is_refused_naming_it(fields, param):
    for body in (MessageBody, RegenerateBody):
        with pytest.raises(ValidationError) as refused:
            body.model_validate({"content": "hi", **fields} if body is MessageBody else fields)
        assert refused.value.errors()[0]["loc"] == (param,)


def test_the_largest_accepted_values_fit_the_engines_sampling_params():
    body = MessageBody.model_validate({"content": "hi", "seed": 2**64 - 1, "max_tokens": 1 << 20, "temperature": 2, "top_p": 1})
    params = body.sampling().params(max_tokens=100)
    assert (params.seed, params.max_tokens, params.temperature, params.top_p) == (2**64 - 1, 100, 2.0, 1.0)


def test_a_conversations_model_name_is_bounded():
    with pytest.raises(ValidationError):
        NewConversationBody.model_validate({"model": "m" * 201})
    assert NewConversationBody.model_validate({"model": "m" * 200}).model == "m" * 200
