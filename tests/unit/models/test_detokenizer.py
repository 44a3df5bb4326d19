"""Streamed text deltas add up to the full decode and never carry half a character."""

from __future__ import annotations

import pytest

from tandem.models.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.real_model

TEXT = "Voilà: 😀 naïve 東京 — 🚀🚀 done. Ελληνικά, emoji 👩‍👩‍👧 end"


def test_deltas_concatenate_to_the_full_decode_without_replacement_chars(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the text does split characters across tokens
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode_chat([{"role": "user", "content": "hi"}]))
    deltas = [detokenizer.add(i) for i in ids]
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # some tokens only started a character and were held back


def test_special_tokens_are_silent_and_spaces_survive(smollm2):
    tokenizer = smollm2.tokenizer
    detokenizer = IncrementalDetokenizer(tokenizer)
    stream = [*tokenizer.encode("Hello there"), 2, *tokenizer.encode(" friend")]
    deltas = [detokenizer.add(i) for i in stream]
    assert deltas == ["Hello", " there", "", " friend"]


def test_a_reply_cut_mid_character_flushes_what_it_has(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode("ok 😀")
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.add(i) for i in ids[:cut])
    assert "\ufffd" not in streamed
    assert streamed + detokenizer.flush() == tokenizer.decode(ids[:cut])
