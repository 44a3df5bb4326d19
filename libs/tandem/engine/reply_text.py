"""A reply's text as it streams: incremental detokenization plus stop strings.

A stop string can arrive split across tokens, so the last (longest stop - 1) characters are
held back until they can no longer start one; when a stop string appears, the text ends right
before it (the stop string itself is never shown), as OpenAI-compatible servers do. Before the
reply's `min_tokens`th token no stop string is looked for (vLLM's rule): one that completes at or
after that token ends the reply, one wholly before it is text.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.models.detokenizer import IncrementalDetokenizer
from tandem.models.tokenizer import Tokenizer


class ReplyText:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._num_tokens_to_min = min_tokens
        self._stop = tuple(s for s in stop if s)
        self._num_held_chars = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._num_emitted_chars = 0
        self.has_hit_stop = False

    def add(self, token_id: int) -> str:
        """The text delta this token releases (possibly empty)."""
        if self.has_hit_stop:
            return ""
        num_checked_chars = max(0, len(self._text) - self._num_held_chars)
        self._text += self._detokenizer.add(token_id)
        self._num_tokens_to_min -= 1
        stops = self._stop if self._num_tokens_to_min <= 0 else ()
        hits = [i for i in (self._text.find(stop, num_checked_chars) for stop in stops) if i != -1]
        if hits:
            self._text = self._text[: min(hits)]
            self.has_hit_stop = True
        releasable = len(self._text) if self.has_hit_stop else len(self._text) - self._num_held_chars
        return self._release(releasable)

    def finish(self) -> str:
        """At the end of the reply: what was held back (no stop string can complete now)."""
        if not self.has_hit_stop:
            self._text += self._detokenizer.flush()
        return self._release(len(self._text))

    def _release(self, up_to_chars: int) -> str:
        if up_to_chars <= self._num_emitted_chars:
            return ""
        delta = self._text[self._num_emitted_chars : up_to_chars]
        self._num_emitted_chars = up_to_chars
        return delta
