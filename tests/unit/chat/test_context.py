"""The context builder: what fits, in which order, and what is refused."""

import pytest

from services.chat.context import Budget, PromptTooLong, Turn, active_history, build_context
from tandem.bus.events import ReplyStatus
from tandem.store import Message, Role

SYSTEM = Turn("system", "Be brief.", 10)


def message(seq: int, role: Role, tokens: int, parent_seq: int = 0, status: ReplyStatus = ReplyStatus.COMPLETE) -> Message:
    return Message(
        id=f"m{seq}",
        conversation_id="c",
        seq=seq,
        parent_seq=parent_seq,
        role=role,
        content=f"text {seq}",
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
