"""SmolLM2's tokenizer, rebuilt from its GGUF vocabulary: special tokens, round trips, chat."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real_model

MIXED_TEXT = "Crème brûlée à Zürich — naïve café. 😀🚀 東京で寿司を食べた。 Ünïcödé ok? 2024-11-29\n\ttabs  and  spaces"


def test_chat_markers_are_single_special_ids(smollm2):
    tokenizer = smollm2.tokenizer
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tokenizer.decode(ids[1:-1]) == "user\nhi"
    assert tokenizer.decode([1, *tokenizer.encode("hi"), 2]) == "hi"
    assert tokenizer.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"


def test_round_trip_of_accents_emoji_and_cjk(smollm2):
    ids = smollm2.tokenizer.encode(MIXED_TEXT)
    assert smollm2.tokenizer.decode(ids) == MIXED_TEXT
    assert len(ids) < len(MIXED_TEXT.encode())  # merges applied, not one token per byte


def test_digits_are_split_one_by_one_as_the_smollm_pre_tokenizer_says(smollm2):
    tokenizer = smollm2.tokenizer
    assert [tokenizer.decode([i]) for i in tokenizer.encode("in 2024")] == ["in", " ", "2", "0", "2", "4"]
    assert [tokenizer.decode([i]) for i in tokenizer.encode("Hello world")] == ["Hello", " world"]


def test_chat_template_renders_im_start_format_with_generation_prompt(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert smollm2.tokenizer.render_chat(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    rendered = smollm2.tokenizer.render_chat(with_system, add_generation_prompt=False)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and rendered.endswith("France?<|im_end|>\n")
