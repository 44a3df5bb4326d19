"""Text is split before BPE the way llama.cpp splits it for the GGUF's `tokenizer.ggml.pre`."""

from __future__ import annotations

import pytest
from tokenizers import pre_tokenizers

from tandem.errors import StartupError
from tandem.models.tokenizer import Tokenizer

TEXT = "I've 12345 cats!!\n\n  ok"


def _metadata(pre: str, model: str = "gpt2") -> dict:
    tokens = ["<s>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    return {
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": [],
    }


def _pieces(pre: str) -> list[str]:
    backend = Tokenizer.from_gguf(_metadata(pre)).backend
    return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(TEXT)]


@pytest.mark.parametrize(
    ("pre", "digits"),
    [
        ("smollm", ["1", "2", "3", "4", "5"]),  # \p{N} first: every digit alone
        ("gpt2", ["Ġ12345"]),  # ` ?\p{N}+`: the run with its space
        ("llama-bpe", ["123", "45"]),  # \p{N}{1,3}
        ("qwen2", ["1", "2", "3", "4", "5"]),
    ],
)
def test_numbers_split_as_the_pre_tokenizer_name_says(pre, digits):
    pieces = _pieces(pre)
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == digits
    assert "".join(pieces) == "".join(_pieces("gpt2"))  # splitting never loses text


def test_an_unknown_pre_tokenizer_or_model_is_refused_by_name():
    with pytest.raises(StartupError, match="pre-tokenizer 'deepseek-llm'"):
        Tokenizer.from_gguf(_metadata("deepseek-llm"))
    with pytest.raises(StartupError, match="tokenizer model 't5'"):
        Tokenizer.from_gguf(_metadata("default", model="t5"))
