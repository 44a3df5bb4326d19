"""The chat service's settings, frozen at start: what each of its parts is given."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import Settings, Tier


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
    max_streams: int = 10000  # open SSE streams on this instance
    stream_limit_free: int = 8  # open SSE streams of one user on this instance, by tier
    stream_limit_plus: int = 32
    stream_limit_pro: int = 20000
    stream_buffer_events: int = 512  # live events queued for one client before it is dropped
    stream_readers: int = 4  # Redis connections reading token logs
    stream_interval_ms: int = 0  # a reply's live events go to its streams at most once this often
    # `auto` (services.chat.model_routing): the two models' served ids, the classifier's threshold,
    # and the fallback rule's length; an empty small model: auto is the large one.
    large_model: str = ""
    small_model: str = ""
    difficulty_threshold: float = 0.5
    fallback_small_max_tokens: int = 200

    @classmethod
    def from_settings(cls, settings: Settings) -> ChatConfig:
        return cls(
            system_prompt=settings.system_prompt,
            max_answer_tokens=settings.max_answer_tokens,
            prompt_budget_free=settings.prompt_budget_free,
            prompt_budget_plus=settings.prompt_budget_plus,
            max_message_chars=settings.max_message_chars,
            idempotency_ttl_s=settings.idempotency_ttl_s,
            max_streams=settings.max_streams,
            stream_limit_free=settings.stream_limit_free,
            stream_limit_plus=settings.stream_limit_plus,
            stream_limit_pro=settings.stream_limit_pro,
            stream_buffer_events=settings.stream_buffer_events,
            stream_readers=settings.stream_readers,
            stream_interval_ms=settings.stream_interval_ms,
            large_model=settings.large_model,
            small_model=settings.small_model,
            difficulty_threshold=settings.difficulty_threshold,
            fallback_small_max_tokens=settings.fallback_small_max_tokens,
        )

    def prompt_budget_for(self, tier: Tier) -> int:
        return self.prompt_budget_free if tier == Tier.FREE else self.prompt_budget_plus

    def stream_limits(self) -> dict[Tier, int]:
        return {Tier.FREE: self.stream_limit_free, Tier.PLUS: self.stream_limit_plus, Tier.PRO: self.stream_limit_pro}
