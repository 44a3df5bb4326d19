"""A reply's OpenAI `logprobs`, from the token ids and logprobs its token events carry.

The engine computes them (tandem.engine.logprobs: the model's own log-probabilities, before the
request's logits processors) only when the request asks, so events without them stay as they
were. A token's text is the tokenizer's decode of its id alone, special tokens skipped as in the
reply's text (a reply that ends at its end-of-sequence token lists that token with the text ""),
so the chosen tokens' texts put together give the reply's text; an alternative is spelt with its
special tokens, so a client sees which it is. `bytes` are the text's UTF-8 bytes (a token that
holds part of a character decodes to U+FFFD, as other servers' single-token decodes do).
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.models.tokenizer import Tokenizer
from tandem.v1.tokens_pb2 import TokenEvent


class ReplyLogprobs:
    """Writes the `logprobs` of a reply's choices, event by event or all at once, in the chat's
    shape (`content`) or the text completion's (`tokens`, `token_logprobs`, `top_logprobs`,
    `text_offset`, the offset counting on from one call to the next)."""

    def __init__(self, tokenizer: Tokenizer, is_chat: bool) -> None:
        self._tokenizer = tokenizer
        self._is_chat = is_chat
        self._num_chars = 0  # the text offset of the next token (text completions)

    def of(self, events: Iterable[TokenEvent]) -> dict[str, object] | None:
        """The choice's `logprobs` for these events' tokens; None when none of them carries any."""
        scored = [event for event in events if event.HasField("logprob")]
        if not scored:
            return None
        return self._chat(scored) if self._is_chat else self._text(scored)

    def _chat(self, events: list[TokenEvent]) -> dict[str, object]:
        content = []
        for event in events:
            text = self._tokenizer.decode([event.token_id])
            top = [_chat_entry(self._spelling(t.token_id), t.logprob) for t in event.top_logprobs]
            content.append({**_chat_entry(text, event.logprob), "top_logprobs": top})
        return {"content": content}

    def _text(self, events: list[TokenEvent]) -> dict[str, object]:
        tokens: list[str] = []
        offsets: list[int] = []
        for event in events:
            tokens.append(self._tokenizer.decode([event.token_id]))
            offsets.append(self._num_chars)
            self._num_chars += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [event.logprob for event in events],
            "top_logprobs": [{self._spelling(t.token_id): t.logprob for t in event.top_logprobs} for event in events],
            "text_offset": offsets,
        }

    def _spelling(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_entry(text: str, logprob: float) -> dict[str, object]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
