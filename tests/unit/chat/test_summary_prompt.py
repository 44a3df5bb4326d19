"""What a conversation summary covers and the prompt asking for it: the turns a prompt left out
that the stored summary does not cover yet, after the summary so far, oldest first; as many of
the oldest as fit the room (the rest wait for a later summary), a first turn too long alone cut
to fit, and nothing when the room holds none; a summary cut by its bound ends at a sentence."""

from __future__ import annotations

import pytest

from services.chat.summary_prompt import (
    CUT_MARK,
    INSTRUCTION,
    SummarySource,
    covers,
    fit_prompt,
    max_words_of,
    source_of,
    summary_messages,
    summary_of_branch,
    tidy,
)
from tandem.bus.events import ReplyStatus
from tandem.models.loader import load_tokenizer
from tandem.models.tokenizer import Tokenizer
from tandem.store import Conversation, Message, Role

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


def message(seq: int, content: str = "") -> Message:
    role = Role.USER if seq % 2 else Role.ASSISTANT
    text = content or f"{role.value} turn {seq}: the capital of country {seq} is city {seq}."
    return Message(f"m{seq}", "c", seq, seq - 1, role, text, 20, "m", ReplyStatus.COMPLETE, seq)


def conversation(summary: str = "", upto_seq: int = 0) -> Conversation:
    return Conversation("c", "u", "t", "m", 0, 0, summary=summary, summary_upto_seq=upto_seq)


def linear(num: int) -> list[Message]:
    return [message(seq) for seq in range(1, num + 1)]


def test_the_source_is_the_dropped_turns_after_the_stored_summary_with_that_summary():
    messages = linear(8)
    source = source_of(conversation("Earlier: the user is Ada.", upto_seq=4), messages[2:6], messages)
    assert source is not None
    assert source.previous == "Earlier: the user is Ada."
    assert [turn.seq for turn in source.turns] == [5, 6], "turns the stored summary covers are not summarised again"
    assert source.upto_seq == 6


def test_no_source_when_the_stored_summary_covers_every_dropped_turn():
    messages = linear(8)
    assert source_of(conversation("s", upto_seq=6), messages[4:6], messages) is None
    assert source_of(conversation("s", upto_seq=7), messages[4:6], messages) is None, "it covers more of the branch"


def branched() -> list[Message]:
    """1-2-3-4-5-6, and 7 an edit of 3 (a sibling of it, after 2): the branch 1-2-7."""
    edit = Message("m7", "c", 7, 2, Role.USER, "an edited turn 3", 20, "m", ReplyStatus.COMPLETE, 7)
    return [*linear(6), edit, Message("m8", "c", 8, 7, Role.ASSISTANT, "its answer", 20, "m", ReplyStatus.COMPLETE, 8)]


def test_a_summary_of_another_branch_is_replaced_not_extended():
    messages = branched()
    stored = conversation("about turns 1 to 5", upto_seq=5)
    source = source_of(stored, [messages[0], messages[1], messages[6]], messages)
    assert source is not None
    assert source.previous == "", "turns 3 to 5 are not on this branch"
    assert [turn.seq for turn in source.turns] == [1, 2, 7]


def test_a_prompt_uses_the_summary_only_on_a_branch_through_its_last_covered_message():
    messages = branched()
    stored = conversation("about turns 1 to 4", upto_seq=4)
    assert summary_of_branch(stored, messages, 6) == stored
    assert summary_of_branch(stored, messages, None) == conversation(), "the newest message (8) is on the edit's branch"
    assert summary_of_branch(stored, messages, 8) == conversation()
    assert summary_of_branch(stored, messages, 0) == conversation(), "a first message edited has no history"
    assert summary_of_branch(conversation("about 1 and 2", upto_seq=2), messages, 8).summary == "about 1 and 2", "shared turns"


def test_covers_means_at_or_before_on_the_summarys_branch():
    messages = branched()
    assert covers(messages, 5, 5) and covers(messages, 5, 3) and covers(messages, 5, 1)
    assert not covers(messages, 5, 6)
    assert not covers(messages, 5, 7), "another branch"
    assert not covers(messages, 0, 1), "no summary covers nothing"


def test_the_prompt_has_the_instruction_the_previous_summary_then_the_turns_oldest_first(tokenizer):
    turns = [message(seq) for seq in (1, 2, 3)]
    messages = summary_messages("The user is Ada.", turns, 50)
    assert messages[0] == {"role": "system", "content": INSTRUCTION}
    text = messages[1]["content"]
    assert text.index("The user is Ada.") < text.index(turns[0].content) < text.index(turns[1].content) < text.index(turns[2].content)
    assert text.startswith("The summary so far:") and "User: " in text and "Assistant: " in text
    assert "at most 50 words" in text
    assert "summary so far" not in summary_messages("", turns, 50)[1]["content"], "no previous summary, no mention of one"


def test_every_turn_is_summarised_when_the_room_holds_them(tokenizer):
    source = SummarySource("", tuple(message(seq) for seq in range(1, 7)))
    prompt = fit_prompt(tokenizer, source, room_tokens=4000, max_words=60)
    assert prompt is not None
    assert (prompt.num_turns, prompt.upto_seq, prompt.is_cut) == (6, 6, False)
    assert prompt.ids == tokenizer.encode_chat(summary_messages("", source.turns, 60))


def test_only_the_oldest_turns_that_fit_are_summarised_and_the_summary_covers_up_to_the_newest_of_them(tokenizer):
    turns = tuple(message(seq) for seq in range(1, 9))
    full = len(tokenizer.encode_chat(summary_messages("", turns, 60)))
    three = len(tokenizer.encode_chat(summary_messages("", turns[:3], 60)))
    prompt = fit_prompt(tokenizer, SummarySource("", turns), room_tokens=three + 2, max_words=60)
    assert three < full
    assert prompt is not None
    assert (prompt.num_turns, prompt.upto_seq) == (3, 3), "the newer turns wait for a later summary"
    assert len(prompt.ids) <= three + 2


def test_the_prompt_never_exceeds_its_room_whatever_the_room(tokenizer):
    turns = tuple(message(seq) for seq in range(1, 12))
    source = SummarySource("The user asked about capitals.", turns)
    for room in (60, 90, 120, 200, 350, 600):
        prompt = fit_prompt(tokenizer, source, room_tokens=room, max_words=40)
        if prompt is not None:
            assert len(prompt.ids) <= room, room
            assert 1 <= prompt.num_turns <= len(turns)


def test_a_first_turn_too_long_alone_is_cut_to_fit_and_counts_as_covered(tokenizer):
    long_turn = message(1, "word " * 3000)
    prompt = fit_prompt(tokenizer, SummarySource("", (long_turn, message(2))), room_tokens=400, max_words=40)
    assert prompt is not None
    assert (prompt.num_turns, prompt.upto_seq, prompt.is_cut) == (1, 1, True)
    assert len(prompt.ids) <= 400
    assert tokenizer.decode(prompt.ids).count("word") > 100, "as much of the turn as fits"
    assert CUT_MARK.strip() in tokenizer.decode(prompt.ids)


def test_no_prompt_when_the_summary_so_far_fills_the_room(tokenizer):
    source = SummarySource("earlier " * 500, (message(1),))
    assert fit_prompt(tokenizer, source, room_tokens=100, max_words=40) is None


def test_a_summary_cut_by_its_bound_ends_at_its_last_full_sentence():
    assert tidy("  Ada lives in Paris. She asked about tra", is_cut_at_length=True) == "Ada lives in Paris."
    assert tidy("Ada lives in Paris. She likes tea.", is_cut_at_length=True) == "Ada lives in Paris. She likes tea."
    assert tidy("no sentence end at all", is_cut_at_length=True) == "no sentence end at all"
    assert tidy(" Ada lives in Paris. She asked ", is_cut_at_length=False) == "Ada lives in Paris. She asked"


def test_the_bound_in_words_follows_the_bound_in_tokens():
    assert max_words_of(200) == 120
    assert max_words_of(5) == 8
