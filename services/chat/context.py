"""The prompt of a chat turn, within the model's window: the system prompt first, then the
conversation's summary if any, then as many of the newest turns as fit, then the new message,
leaving room for the answer. Stable parts come first so they stay a cached prefix.

Token counts come from the stored messages (counted once, when saved), so choosing what fits
never re-tokenizes the history."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.bus.events import ReplyStatus
from tandem.store import BRANCH_ROOT, Message, Role


@dataclass(frozen=True)
class Budget:
    window_tokens: int  # the model's context window
    tier_prompt_tokens: int  # what the caller's tier may send
    answer_tokens: int  # kept free for the answer

    @property
    def prompt_tokens(self) -> int:
        return min(self.window_tokens, self.tier_prompt_tokens) - self.answer_tokens

    def check(self, num_tokens: int, what: str = "the message and the system prompt") -> None:
        """Raises PromptTooLong for a prompt of `num_tokens` over the budget."""
        if num_tokens > self.prompt_tokens:
            raise PromptTooLong(num_tokens, self.prompt_tokens, what)


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
    """`what`: what needs the tokens, as the message names it."""

    def __init__(self, num_tokens: int, budget_tokens: int, what: str = "the message and the system prompt") -> None:
        self.num_tokens = num_tokens
        self.budget_tokens = budget_tokens
        super().__init__(f"{what} need {num_tokens} tokens but this conversation may send at most {budget_tokens}")


# A conversation is a tree: each message follows its parent (an answer follows the user turn it
# answers; a user turn follows the answer it replies to). Regenerating an answer adds a sibling
# to it; editing a sent message adds a sibling to that message. The branch the model sees runs
# from the root to one message, its tip: by default the newest message (the branch last written).


def parent_seqs(messages: Sequence[Message]) -> dict[int, int]:
    """Each message's parent seq, 0 for the root. A stored parent_seq of 0 was not recorded
    (messages written before branches, or by a writer that does not say): the message before it."""
    parents: dict[int, int] = {}
    previous = 0
    for message in sorted(messages, key=lambda m: m.seq):
        if message.parent_seq == BRANCH_ROOT:
            parents[message.seq] = 0
        elif message.parent_seq > 0:
            parents[message.seq] = message.parent_seq
        else:
            parents[message.seq] = previous
        previous = message.seq
    return parents


def stored_parent_seq(tip_seq: int) -> int:
    """What a new message that follows `tip_seq` (0: the root) stores as its parent_seq."""
    return tip_seq if tip_seq > 0 else BRANCH_ROOT


def default_tip(messages: Sequence[Message]) -> int:
    """The seq the active branch ends at when no one chose: the newest message (0 when none)."""
    return max((m.seq for m in messages), default=0)


def active_branch(messages: Sequence[Message], tip_seq: int | None = None) -> list[Message]:
    """The messages from the root to `tip_seq` (default: the newest message), in order."""
    by_seq = {m.seq: m for m in messages}
    parents = parent_seqs(messages)
    branch: list[Message] = []
    seq = default_tip(messages) if tip_seq is None else tip_seq
    while seq in by_seq and len(branch) < len(by_seq):  # the length bound: a corrupt cycle ends too
        branch.append(by_seq[seq])
        seq = parents[seq]
    branch.reverse()
    return branch


def active_history(messages: Sequence[Message], summary_upto_seq: int = 0, tip_seq: int | None = None) -> list[Message]:
    """The turns the model should see: the branch to `tip_seq` (default: the newest message)
    without what the summary covers, without answers that failed or are still being written, and
    without user turns the input check refused (stored to show, never sent to a model)."""
    return [
        m
        for m in active_branch(messages, tip_seq)
        if m.seq > summary_upto_seq
        and (
            (m.role == Role.USER and m.status != ReplyStatus.MODERATED)
            or (m.status in (ReplyStatus.COMPLETE, ReplyStatus.STOPPED) and m.content)
        )
    ]


def build_context(system: Turn, summary: Turn | None, history: Sequence[Message], new: Turn, budget: Budget) -> Context:
    """Fits the newest history turns that fit whole, stopping at the first that does not (no holes)."""
    fixed = [system] + ([summary] if summary is not None else [])
    num_fixed_tokens = sum(turn.tokens for turn in fixed) + new.tokens
    budget.check(num_fixed_tokens)
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
