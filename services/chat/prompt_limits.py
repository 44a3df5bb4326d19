"""The limits a prompt meets before any reply starts, one definition for the product API and the
OpenAI endpoints: each message's characters (`max_message_chars`) and the tier's prompt budget in
tokens (services.chat.context.Budget, from ChatConfig.prompt_budget). Either refusal is a 413
(`message_too_long`, `prompt_too_long`), before any quota is reserved or anything stored."""

from __future__ import annotations

from services.chat.context import Budget, PromptTooLong
from services.chat.errors import TooLarge


def check_message_chars(content: str, max_chars: int, param: str) -> None:
    if len(content) > max_chars:
        message = f"the message has {len(content)} characters; at most {max_chars} are accepted"
        raise TooLarge(message, code="message_too_long", param=param)


def prompt_too_long(exc: PromptTooLong, param: str | None = None) -> TooLarge:
    return TooLarge(str(exc), code="prompt_too_long", param=param)


def check_prompt_tokens(num_tokens: int, budget: Budget, param: str) -> None:
    """A whole prompt of `num_tokens` (an OpenAI request's, nothing of it to drop) within `budget`."""
    try:
        budget.check(num_tokens, f"the {param}")
    except PromptTooLong as exc:
        raise prompt_too_long(exc, param) from None
