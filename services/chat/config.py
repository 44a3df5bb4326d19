"""The chat service's settings, frozen at start: what each of its parts is given."""

from __future__ import annotations

from dataclasses import dataclass

from services.chat.context import Budget
from tandem.config import Settings, Tier


@dataclass(frozen=True)
class AnswerLength:
    """A tier's answer length in tokens: the max_tokens of a request that names none, and the most
    one may name (None: only the context window bounds it)."""

    default_tokens: int
    cap_tokens: int | None = None

    def max_tokens(self, requested: int | None) -> int:
        """An answer's max_tokens before the window's room: the one asked for, else the default,
        within the cap."""
        wanted = requested or self.default_tokens
        return wanted if self.cap_tokens is None else min(wanted, self.cap_tokens)


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
    # New streams' Redis reads (services.chat.attach_reads): at once, waiting at most, and how long one waits.
    stream_attach_reads: int = 16
    stream_attach_queue: int = 4096
    stream_attach_wait_s: float = 15.0
    # `auto` (services.chat.model_routing): the two models' served ids, the classifier's threshold,
    # and the fallback rule's length; an empty small model: auto is the large one.
    large_model: str = ""
    small_model: str = ""
    difficulty_threshold: float = 0.5
    fallback_small_max_tokens: int = 200
    # Each tier's longest answer, also its default max_tokens; None: max_answer_tokens is the
    # default, and only the window caps what a request asks (the router's overload ladder may cap it lower).
    max_answer_tokens_free: int | None = None
    max_answer_tokens_plus: int | None = None
    max_answer_tokens_pro: int | None = None

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
            stream_attach_reads=settings.stream_attach_reads,
            stream_attach_queue=settings.stream_attach_queue,
            stream_attach_wait_s=settings.stream_attach_wait_s,
            large_model=settings.large_model,
            small_model=settings.small_model,
            difficulty_threshold=settings.difficulty_threshold,
            fallback_small_max_tokens=settings.fallback_small_max_tokens,
            max_answer_tokens_free=settings.max_answer_tokens_free,
            max_answer_tokens_plus=settings.max_answer_tokens_plus,
            max_answer_tokens_pro=settings.max_answer_tokens_pro,
        )

    def prompt_budget_for(self, tier: Tier) -> int:
        return self.prompt_budget_free if tier == Tier.FREE else self.prompt_budget_plus

    def prompt_budget(self, tier: Tier, window_tokens: int, num_framing_tokens: int = 0) -> Budget:
        """What a prompt of `tier` may hold on a model of `window_tokens`, keeping room for the
        tier's default answer (at most half the window). `num_framing_tokens`: tokens the prompt
        will hold that its count leaves out (the chat template's generation prompt)."""
        return Budget(
            window_tokens=window_tokens - num_framing_tokens,
            tier_prompt_tokens=self.prompt_budget_for(tier),
            answer_tokens=min(self.answer_length(tier).default_tokens, window_tokens // 2),
        )

    def stream_limits(self) -> dict[Tier, int]:
        return {Tier.FREE: self.stream_limit_free, Tier.PLUS: self.stream_limit_plus, Tier.PRO: self.stream_limit_pro}

    def answer_length(self, tier: Tier) -> AnswerLength:
        cap = {Tier.FREE: self.max_answer_tokens_free, Tier.PLUS: self.max_answer_tokens_plus, Tier.PRO: self.max_answer_tokens_pro}[tier]
        return AnswerLength(cap or self.max_answer_tokens, cap)

    def answer_lengths(self) -> dict[Tier, AnswerLength]:
        return {tier: self.answer_length(tier) for tier in Tier}
