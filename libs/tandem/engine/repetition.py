"""The repetition stop: a reply whose output ends with one n-gram repeated over and over has run
away (a small model's loop: the same line of a table, the same verse), and is ended at once with
finish LENGTH and stop reason REPETITION instead of writing on to max_tokens.

The tail is periodic: its last `n * copies` tokens are `copies` copies of its last n tokens, for
some n up to `max_ngram_tokens`, where `copies` is at least `min_repeats` and the copies cover at
least `min_span_tokens` (a short n-gram must repeat more often: a run of one digit, a row of
`|---` or an address of zeros is ordinary text at a few dozen tokens, a loop past them).

Cheap per step, on the host, over the tail only: the last token's earlier places among the
`max_ngram_tokens` before it (a scan in C) are the only n that can repeat; each is checked by
comparing two slices of the tail. Only output tokens count (a continuation's generated tokens are
output, so a loop that began on a worker that died is still seen on the next one)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from tandem.engine.sequence import Sequence


@dataclass(frozen=True)
class RepetitionStop:
    max_ngram_tokens: int = 64  # the longest n-gram (period) looked for
    min_repeats: int = 3  # copies of it in a row
    min_span_tokens: int = 64  # tokens the copies cover at least

    def __post_init__(self) -> None:
        if self.max_ngram_tokens < 1 or self.min_repeats < 2 or self.min_span_tokens < 0:
            raise ValueError(f"invalid repetition stop: {self}")

    def repeats_needed(self, ngram_tokens: int) -> int:
        """The copies of an n-gram of this length in a row that end a reply."""
        return max(self.min_repeats, -(-self.min_span_tokens // ngram_tokens))

    def repeated_ngram(self, seq: Sequence) -> int | None:
        """The length of the n-gram the output now ends repeating, the shortest; None when it does
        not. Replies that ask for every token (ignore_eos: a benchmark's fixed lengths) and the
        first min_tokens of any reply are never ended by it."""
        if seq.sampling.ignore_eos or seq.num_output_tokens <= seq.sampling.min_tokens:
            return None
        num_output = seq.num_output_tokens
        max_ngram = min(self.max_ngram_tokens, num_output // self.min_repeats)
        if max_ngram < 1:
            return None
        token_ids = seq.token_ids
        last = token_ids[-1]
        before = token_ids[-2 : -2 - max_ngram : -1]  # before[i] is the token i + 1 places back
        if last not in before:  # most steps end here
            return None
        for ngram in _places(before, last):
            span = ngram * self.repeats_needed(ngram)
            if span <= num_output:
                tail = token_ids[-span:]
                if tail[ngram:] == tail[:-ngram]:
                    return ngram
        return None


def _places(before: list[int], token_id: int) -> Iterator[int]:
    """How many places back `token_id` stands in `before`, nearest first."""
    start = 0
    while True:
        try:
            index = before.index(token_id, start)
        except ValueError:
            return
        yield index + 1
        start = index + 1
