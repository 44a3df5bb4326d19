"""The context builder: what fits, in which order, and what is refused."""

import pytest

from services.chat.context import (
    Budget,
    PromptTooLong,
    Turn,
    active_branch,
    active_history,
    build_context,
    default_tip,
    parent_seqs,
    stored_parent_seq,
)
from tandem.bus.events import ReplyStatus
from tandem.store import BRANCH_ROOT, Message, Role

SYSTEM = Turn("system", "Be brief.", 10)


def message(
    seq: int, role: Role, tokens: int, parent_seq: int = 0, status: ReplyStatus = ReplyStatus.COMPLETE, content: str = ""
) -> Message:
    return Message(
        id=f"m{seq}",
        conversation_id="c",
        seq=seq,
        parent_seq=parent_seq,
        role=role,
        content=content or f"text {seq}",
        tokens=tokens,
        model="m",
        status=status,
        created_at_ms=seq,
    )


def conversation(num_pairs: int, tokens: int = 100) -> list[Message]:
    out = []
    for i in range(num_pairs):
        out.append(message(2 * i + 1, Role.USER, tokens))
        out.append(message(2 * i + 2, Role.ASSISTANT, tokens, parent_seq=2 * i + 1))
    return out


def test_the_budget_is_the_smaller_of_window_and_tier_less_the_answer():
    assert Budget(window_tokens=8192, tier_prompt_tokens=32000, answer_tokens=512).prompt_tokens == 7680
    assert Budget(window_tokens=8192, tier_prompt_tokens=2000, answer_tokens=512).prompt_tokens == 1488


def test_everything_fits_in_order_system_first_new_message_last():
    history = conversation(3)
    context = build_context(SYSTEM, None, history, Turn("user", "new", 5), Budget(8192, 8000, 512))
    assert [t.content for t in context.turns] == ["Be brief."] + [m.content for m in history] + ["new"]
    assert context.num_tokens == 10 + 600 + 5
    assert context.num_dropped == 0


def test_the_newest_turns_are_kept_and_the_oldest_dropped():
    history = conversation(5)  # 10 turns of 100 tokens
    context = build_context(SYSTEM, None, history, Turn("user", "new", 5), Budget(1000, 8000, 500))  # room 485
    assert [t.content for t in context.turns[1:-1]] == ["text 7", "text 8", "text 9", "text 10"]
    assert context.num_dropped == 6
    assert context.num_tokens <= 500


def test_it_stops_at_the_first_turn_that_does_not_fit_leaving_no_hole():
    history = [message(1, Role.USER, 10), message(2, Role.ASSISTANT, 10, 1), message(3, Role.USER, 400), message(4, Role.ASSISTANT, 10, 3)]
    context = build_context(SYSTEM, None, history, Turn("user", "new", 5), Budget(1000, 8000, 700))  # room 285
    # turn 3 (400 tokens) does not fit: turns 1 and 2 would fit but are not taken past the hole
    assert [t.content for t in context.turns[1:-1]] == ["text 4"]
    assert context.num_dropped == 3


def test_the_summary_follows_the_system_prompt():
    summary = Turn("system", "Summary so far.", 20)
    context = build_context(SYSTEM, summary, conversation(1), Turn("user", "new", 5), Budget(8192, 8000, 512))
    assert [t.content for t in context.turns[:2]] == ["Be brief.", "Summary so far."]


def test_a_message_that_cannot_fit_with_the_system_prompt_is_refused_with_the_counts():
    with pytest.raises(PromptTooLong) as raised:
        build_context(SYSTEM, None, [], Turn("user", "huge", 600), Budget(1000, 8000, 500))
    assert (raised.value.num_tokens, raised.value.budget_tokens) == (610, 500)
    assert "610" in str(raised.value) and "500" in str(raised.value)


def test_the_active_history_keeps_the_latest_answer_of_each_user_turn():
    messages = [
        message(1, Role.USER, 10),
        message(2, Role.ASSISTANT, 10, 1),
        message(3, Role.ASSISTANT, 10, 1),  # regenerated
        message(4, Role.USER, 10),
        message(5, Role.ASSISTANT, 10, 4, status=ReplyStatus.FAILED),
    ]
    assert [m.seq for m in active_history(messages)] == [1, 3, 4]


def test_the_active_history_skips_what_the_summary_covers():
    assert [m.seq for m in active_history(conversation(3), summary_upto_seq=4)] == [5, 6]


def edited_conversation() -> list[Message]:
    """Two turns, then the second user message edited (5 replaces 3) and answered (6)."""
    return [
        message(1, Role.USER, 10, BRANCH_ROOT, content="Hi, I am Ada."),
        message(2, Role.ASSISTANT, 10, 1, content="Hello Ada."),
        message(3, Role.USER, 10, 2, content="Tell me about cats."),
        message(4, Role.ASSISTANT, 10, 3, content="Cats purr."),
        message(5, Role.USER, 10, 2, content="Tell me about dogs."),
        message(6, Role.ASSISTANT, 10, 5, content="Dogs bark."),
    ]


def test_after_an_edit_the_model_sees_the_new_branch_not_the_old_message_or_its_answer():
    messages = edited_conversation()
    history = active_history(messages)
    assert [m.seq for m in history] == [1, 2, 5, 6]
    # The prompt of the next turn, as the context builder assembles it.
    context = build_context(SYSTEM, None, history, Turn("user", "And birds?", 5), Budget(1000, 8000, 100))
    prompt = "\n".join(turn.content for turn in context.turns)
    assert "dogs" in prompt and "Dogs bark." in prompt and "Hello Ada." in prompt
    assert "cats" not in prompt and "Cats purr." not in prompt


def test_the_branch_to_a_chosen_tip_follows_that_branch():
    messages = edited_conversation()
    assert [m.seq for m in active_history(messages, tip_seq=4)] == [1, 2, 3, 4]
    assert [m.seq for m in active_history(messages, tip_seq=2)] == [1, 2]
    assert active_history(messages, tip_seq=0) == []


def test_an_edited_first_message_starts_a_branch_at_the_root():
    messages = edited_conversation() + [
        message(7, Role.USER, 10, BRANCH_ROOT, content="Who are you?"),
        message(8, Role.ASSISTANT, 10, 7),
    ]
    assert [m.seq for m in active_branch(messages)] == [7, 8]
    assert [m.seq for m in active_branch(messages, tip_seq=6)] == [1, 2, 5, 6]


def test_a_regenerated_earlier_answer_is_a_branch_of_its_own_and_the_later_turns_stay_on_theirs():
    messages = conversation(2) + [message(5, Role.ASSISTANT, 10, 1)]  # a new answer to message 1
    assert [m.seq for m in active_branch(messages)] == [1, 5]
    assert [m.seq for m in active_branch(messages, tip_seq=4)] == [1, 2, 3, 4]


def test_an_unrecorded_parent_is_the_message_before_it():
    messages = [message(1, Role.USER, 10), message(2, Role.ASSISTANT, 10, 1), message(3, Role.USER, 10), message(4, Role.ASSISTANT, 10, 3)]
    assert parent_seqs(messages) == {1: 0, 2: 1, 3: 2, 4: 3}
    assert default_tip(messages) == 4 and default_tip([]) == 0


def test_a_message_that_follows_the_root_stores_the_branch_root():
    assert stored_parent_seq(0) == BRANCH_ROOT
    assert stored_parent_seq(6) == 6
