"""What the chat process's lifespan owns, and the `Annotated` dependencies that hand it to routes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from redis.asyncio import Redis

from services.chat.errors import Unavailable
from services.chat.models_view import ModelsView
from tandem.bus import Bus
from tandem.config import ApiKey, Settings, Tier
from tandem.models.tokenizer import Tokenizer
from tandem.store import ConversationStore


@dataclass(frozen=True)
class ChatConfig:
    system_prompt: str
    max_answer_tokens: int
    prompt_budget_free: int
    prompt_budget_plus: int
    max_message_chars: int
    idempotency_ttl_s: int
    generate_timeout_s: float = 5.0
    reader_lease_s: float = 15.0  # a streaming client's lease, renewed every third of it
    keepalive_s: float = 15.0
    # A running turn whose reply log is missing for longer than this after it was stored is lost
    # (chat stores the turn, then records the reply in Redis a moment later).
    lost_reply_grace_s: float = 30.0

    @classmethod
    def from_settings(cls, settings: Settings) -> ChatConfig:
        return cls(
            system_prompt=settings.system_prompt,
            max_answer_tokens=settings.max_answer_tokens,
            prompt_budget_free=settings.prompt_budget_free,
            prompt_budget_plus=settings.prompt_budget_plus,
            max_message_chars=settings.max_message_chars,
            idempotency_ttl_s=settings.idempotency_ttl_s,
        )

    def prompt_budget_for(self, tier: Tier) -> int:
        return self.prompt_budget_free if tier == Tier.FREE else self.prompt_budget_plus


@dataclass
class ChatState:
    config: ChatConfig
    instance_id: str
    api_keys: dict[str, ApiKey]
    store: ConversationStore
    redis: Redis  # short commands
    stream_redis: Redis  # blocking log reads: a socket timeout longer than the block
    bus: Bus
    models: ModelsView
    tokenizer: Tokenizer | None = None  # loaded at start

    def require_tokenizer(self) -> Tokenizer:
        """The tokenizer; a request that needs it before it has loaded is told to retry."""
        if self.tokenizer is None:
            raise Unavailable("the service is still starting (loading the tokenizer); try again shortly", code="starting")
        return self.tokenizer


def chat_state(request: Request) -> ChatState:
    return request.app.state.chat


State = Annotated[ChatState, Depends(chat_state)]
