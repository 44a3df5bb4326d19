"""The prompt of a chat turn, within the model's window: the system prompt first, then the
conversation's summary if any, then as many of the newest turns as fit, then the new message,
leaving room for the answer. Stable parts come first so they stay a cached prefix.

Token counts come from the stored messages (counted once, when saved), so choosing what fits
never re-tokenizes the history."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.bus.events import ReplyStatus
from tandem.store import Message, Role


@dataclass(frozen=True)
class Budget:
    window_tokens: int  # the model's context window
    tier_prompt_tokens: int  # what the caller's tier may send
    answer_tokens: int  # kept free for the answer

    @property
    def prompt_tokens(self) -> int:
        return min(self.window_tokens, self.tier_prompt_tokens) - self.answer_tokens


@dataclass(frozen=True)
class Turn:
    role: str
    content: str
    tokens: int


@dataclass(frozen=True)
class Context:
    turns: tuple[Turn, ...]  # system, summary, history, new message
    num_tokens: int
    num_dropped: int  # history turns that did not fit


class PromptTooLong(ValueError):
    def __init__(self, num_tokens: int, budget_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.budget_tokens = budget_tokens
        super().__init__(
            f"the message and the system prompt need {num_tokens} tokens but this conversation may send at most {budget_tokens}"
        )


def active_branch(messages: Sequence[Message]) -> list[Message]:
    """Each user turn followed by its latest answer (a regenerated answer replaces the earlier ones)."""
    latest_answer = {m.parent_seq: m for m in messages if m.role == Role.ASSISTANT}
    branch = []
    for message in messages:
        if message.role == Role.USER:
            branch.append(message)
            if message.seq in latest_answer:
                branch.append(latest_answer[message.seq])
    return branch


def active_history(messages: Sequence[Message], summary_upto_seq: int = 0) -> list[Message]:
    """The turns the model should see: the active branch without what the summary covers and
    without answers that failed or are still being written."""
    return [
        m
        for m in active_branch(messages)
        if m.seq > summary_upto_seq and (m.role == Role.USER or (m.status in (ReplyStatus.COMPLETE, ReplyStatus.STOPPED) and m.content))
    ]


def build_context(system: Turn, summary: Turn | None, history: Sequence[Message], new: Turn, budget: Budget) -> Context:
    """Fits the newest history turns that fit whole, stopping at the first that does not (no holes)."""
    fixed = [system] + ([summary] if summary is not None else [])
    num_fixed_tokens = sum(turn.tokens for turn in fixed) + new.tokens
    if num_fixed_tokens > budget.prompt_tokens:
        raise PromptTooLong(num_fixed_tokens, budget.prompt_tokens)
    room = budget.prompt_tokens - num_fixed_tokens
    kept: list[Turn] = []
    for message in reversed(history):
        if message.tokens > room:
            break
        room -= message.tokens
        kept.append(Turn(message.role.value, message.content, message.tokens))
    kept.reverse()
    turns = (*fixed, *kept, new)
    return Context(turns=turns, num_tokens=sum(turn.tokens for turn in turns), num_dropped=len(history) - len(kept))
