"""Streaming text: one token id in, the new text out.

A token is not a unit of text. Byte-level BPE splits multi-byte characters across tokens (an
emoji can take three), and some decoders change a token's text depending on what precedes it
(leading-space handling). So, as vLLM's detokenize_incrementally does, each step decodes a short
window of earlier tokens with and without the new ones and emits the difference, and emits
nothing while the text ends in U+FFFD (a character whose remaining bytes have not arrived).
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.models.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context for the first output token's decode.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        # token_ids[prefix_offset:read_offset] is context already emitted; [read_offset:] is pending
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_id: int) -> str:
        """The text this token completes; "" while it only starts a character (or is special)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of the reply: whatever is still held back (a truncated character decodes as
        U+FFFD, which is then the honest text)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
