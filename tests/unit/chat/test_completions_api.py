"""A text completion's prompt: one string or one list of token ids, however it is wrapped."""

import pytest

from services.chat.completions_api import TextCompletionBody
from services.chat.errors import InvalidRequest


def prompt_of(prompt) -> str | list[int]:
    return TextCompletionBody.model_validate({"model": "m", "prompt": prompt}).only_prompt()


@pytest.mark.parametrize(("prompt", "expected"), [("Once", "Once"), (["Once"], "Once"), ([1, 2, 3], [1, 2, 3]), ([[1, 2]], [1, 2])])
def test_one_prompt_is_accepted_in_each_of_openais_forms(prompt, expected):
    assert prompt_of(prompt) == expected


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], "", [""], []])
def test_a_batch_or_an_empty_prompt_is_refused_naming_prompt(prompt):
    with pytest.raises(InvalidRequest) as refused:
        prompt_of(prompt)
    assert refused.value.param == "prompt"


def test_echo_and_suffix_are_refused_by_name():
    for field, value in (("echo", True), ("suffix", "end"), ("best_of", 3)):
        body = TextCompletionBody.model_validate({"model": "m", "prompt": "x", field: value})
        with pytest.raises(InvalidRequest) as refused:
            body.refuse_unsupported()
        assert refused.value.param == field


def test_an_unknown_field_on_a_text_completion_is_ignored_not_refused():
    body = TextCompletionBody.model_validate({"model": "m", "prompt": "x", "vendor_field": True})
    body.refuse_unsupported()
    assert body.ignored_fields() == ["vendor_field"]
