"""What a conversation's summary covers and the prompt that asks the model for it: the summary
so far and the history turns a prompt left out that it does not cover yet, oldest first, as one
transcript, within the room the model's window leaves beside the summary's own bound. When they
do not all fit, the oldest that fit are summarised now (the summary then covers up to the newest
of them) and the rest by a later summary; a first turn too long alone is cut to fit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from services.chat.context import active_branch
from tandem.models.tokenizer import Tokenizer
from tandem.store import Conversation, Message, Role

INSTRUCTION = (
    "You keep the running summary of a conversation between a user and an assistant. "
    "Keep what later answers need: the user's facts, names, numbers, preferences and requests, "
    "what the assistant answered or decided, and questions still open. "
    "Write plain sentences in the third person, with no preamble."
)
CUT_MARK = " …"
WORDS_PER_TOKEN = 0.6  # a rough English rate: a bound in words the model can follow


@dataclass(frozen=True)
class SummarySource:
    """The summary so far and the turns, oldest first, that the new one adds to it."""

    previous: str
    turns: tuple[Message, ...]

    @property
    def upto_seq(self) -> int:
        return max(turn.seq for turn in self.turns)


@dataclass(frozen=True)
class SummaryPrompt:
    ids: list[int]
    upto_seq: int  # the newest turn it covers
    num_turns: int
    is_cut: bool  # its one turn was cut to fit


def summary_of_branch(conversation: Conversation, messages: Sequence[Message], tip_seq: int | None) -> Conversation:
    """The conversation as a prompt on the branch to `tip_seq` (None: the newest message) sees it.
    A summary stands for the turns of the branch it was written on, from the root to its upto
    message; on a branch that does not pass through that message (an earlier message edited) it
    stands for nothing, and is left out with its upto."""
    upto = conversation.summary_upto_seq
    if upto == 0 or upto in _seqs_to(messages, tip_seq):
        return conversation
    return replace(conversation, summary="", summary_upto_seq=0)


def source_of(conversation: Conversation, dropped: Sequence[Message], messages: Sequence[Message]) -> SummarySource | None:
    """What a new summary of the `dropped` turns (of one branch, oldest first) is written from:
    the stored summary, when it is this branch's, and the dropped turns it does not cover yet (a
    summary written since they were dropped may cover some); a summary of another branch is
    replaced. None when the stored summary covers them all."""
    newest = max(m.seq for m in dropped)
    upto = conversation.summary_upto_seq
    if upto and upto in _seqs_to(messages, newest):
        previous, turns = conversation.summary, [m for m in dropped if m.seq > upto]
    elif upto and covers(messages, upto, newest):
        return None
    else:
        previous, turns = "", list(dropped)
    turns.sort(key=lambda m: m.seq)
    return SummarySource(previous, tuple(turns)) if turns else None


def covers(messages: Sequence[Message], summary_upto_seq: int, seq: int) -> bool:
    """Whether a summary up to `summary_upto_seq` covers message `seq` (on its branch, at or before it)."""
    return summary_upto_seq > 0 and seq in _seqs_to(messages, summary_upto_seq)


def _seqs_to(messages: Sequence[Message], tip_seq: int | None) -> set[int]:
    return {m.seq for m in active_branch(messages, tip_seq)}


def max_words_of(max_tokens: int) -> int:
    return max(8, int(max_tokens * WORDS_PER_TOKEN))


def summary_messages(previous: str, turns: Sequence[Message], max_words: int) -> list[dict[str, str]]:
    transcript = "\n\n".join(f"{'User' if turn.role == Role.USER else 'Assistant'}: {turn.content}" for turn in turns)
    parts = [f"The summary so far:\n{previous}"] if previous else []
    parts.append(f"The conversation{' that follows it' if previous else ''}:\n{transcript}")
    parts.append(f"Write the {'updated ' if previous else ''}summary in at most {max_words} words.")
    return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": "\n\n".join(parts)}]


def fit_prompt(tokenizer: Tokenizer, source: SummarySource, room_tokens: int, max_words: int) -> SummaryPrompt | None:
    """The prompt over the previous summary and the most of the oldest turns that fit in
    `room_tokens`; None when not even a cut first turn fits (the summary so far fills it)."""

    def encode(turns: Sequence[Message]) -> list[int]:
        return tokenizer.encode_chat(summary_messages(source.previous, turns, max_words))

    turns = source.turns
    num_turns = _largest_fitting(len(turns), lambda n: len(encode(turns[:n])) <= room_tokens)
    if num_turns > 0:
        return SummaryPrompt(encode(turns[:num_turns]), turns[num_turns - 1].seq, num_turns, is_cut=False)
    first = turns[0]

    def cut(num_chars: int) -> Message:
        return replace(first, content=first.content[:num_chars] + CUT_MARK)

    num_chars = _largest_fitting(len(first.content), lambda n: len(encode([cut(n)])) <= room_tokens)
    if num_chars == 0:
        return None
    return SummaryPrompt(encode([cut(num_chars)]), first.seq, 1, is_cut=True)


def tidy(text: str, is_cut_at_length: bool) -> str:
    """The summary as stored: stripped, and when the bound cut it mid-sentence, ended at its last
    full sentence (if it has one)."""
    text = text.strip()
    if is_cut_at_length and not text.endswith((".", "!", "?")):
        end = max(text.rfind(mark) for mark in (". ", "! ", "? ", ".\n"))
        if end > 0:
            text = text[: end + 1]
    return text


def _largest_fitting(num: int, fits: Callable[[int], bool]) -> int:
    """The largest n in 0..num with fits(n), for a `fits` true up to some n and false after (0 when none)."""
    low, high = 0, num
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
