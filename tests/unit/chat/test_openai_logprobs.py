"""A reply's token events as OpenAI's `logprobs`: the chat's `content` entries and the text
completion's columns, spelt by the model's tokenizer; events without logprobs give none."""

from __future__ import annotations

import pytest

from services.chat.openai_logprobs import ReplyLogprobs
from tandem.models.loader import load_tokenizer
from tandem.models.tokenizer import Tokenizer
from tandem.v1.tokens_pb2 import TokenEvent, TokenLogprob

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


def events_of(tokenizer: Tokenizer, text: str) -> list[TokenEvent]:
    """One event per token of `text`, then the end-of-sequence token, each with made-up logprobs."""
    ids = tokenizer.encode(text) + [tokenizer.eos_token_ids[0]]
    events = []
    for seq, token_id in enumerate(ids, start=1):
        top = [TokenLogprob(token_id=token_id, logprob=-0.5), TokenLogprob(token_id=tokenizer.eos_token_ids[0], logprob=-2.0)]
        events.append(TokenEvent(seq=seq, token_id=token_id, logprob=-0.5, top_logprobs=top))
    return events


def test_chat_content_entries_spell_the_reply_token_by_token_and_name_special_alternatives(tokenizer):
    events = events_of(tokenizer, "The capital of France is Paris.")
    logprobs = ReplyLogprobs(tokenizer, is_chat=True).of([TokenEvent(seq=99)] + events)  # an event without logprobs is skipped
    assert logprobs is not None
    content = logprobs["content"]
    assert len(content) == len(events)
    assert "".join(entry["token"] for entry in content) == "The capital of France is Paris."
    assert content[-1]["token"] == "", "the end-of-sequence token is no part of the text"
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] == -0.5
        assert [alt["logprob"] for alt in entry["top_logprobs"]] == [-0.5, -2.0]
        assert entry["top_logprobs"][1]["token"] == tokenizer.decode(tokenizer.eos_token_ids[:1], skip_special_tokens=False) != ""


def test_text_completion_offsets_count_on_from_one_streamed_event_to_the_next(tokenizer):
    events = events_of(tokenizer, " Paris, the capital")
    whole = ReplyLogprobs(tokenizer, is_chat=False).of(events)
    streamed = ReplyLogprobs(tokenizer, is_chat=False)
    parts = [streamed.of([event]) for event in events]
    assert whole is not None and all(part is not None for part in parts)
    assert [part["text_offset"][0] for part in parts] == whole["text_offset"]
    tokens = whole["tokens"]
    assert "".join(tokens) == " Paris, the capital"
    assert whole["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert whole["token_logprobs"] == [-0.5] * len(events) and len(whole["top_logprobs"][0]) == 2


def test_events_without_logprobs_give_none(tokenizer):
    assert ReplyLogprobs(tokenizer, is_chat=True).of([TokenEvent(seq=1, token_id=5, text="x")]) is None
