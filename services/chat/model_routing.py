"""Which model answers a message: the decision behind `model: "auto"`.

1. A paid user (plus, pro) who names a model gets it.
2. Otherwise (auto, or a free user: a free user's named model is checked to exist, then treated as
   auto) a conversation stays on the model it is on: the one its newest user turn was routed to.
3. Otherwise the difficulty classifier's score decides (services.chat.difficulty): at least the
   threshold goes to the large model, below it to the small one; with no classifier, or one that
   raised or missed its deadline, the fallback rule does (short and without code: small).
4. A decided model that no worker serves right now gives way to the other one (`instead_of`); so
   does one whose pool the router finds down or full (services.router, `answered_by`).

5. A message the user's quota cannot afford on its route goes to the small model instead, from the
   small model's own bucket (`quota_fallback`, decided by `quota_fallback`: services.chat.replies),
   when the tier falls back and a small model is configured and served. The product API always
   may; the OpenAI API only for `auto` (a client that named its model gets that one or a 429, as
   vLLM would answer it).

Versions (workers' model_version: tandem.model_ids): large, small and a model named without a
version stand for every version of that name, and the routers' rollout picks the version a new
conversation gets; the version that answered its newest user turn is the one it stays on
(conversation_model), also when a user names the model without a version; a user's named
`name@version` moves it. A version nobody serves any more gives way to its name's current one.

With no small model configured, everything goes to the large one (decided by `single_model`), as
before there were two. Each decision is counted (tandem_chat_model_routes_total), its score
observed, and logged under the request id."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import NamedTuple

from services.chat import metrics
from services.chat.config import ChatConfig
from services.chat.difficulty import NONE, DifficultyJudge, Scored, fallback_is_small
from services.chat.errors import NotFound, Unavailable
from services.chat.models_view import ModelsView, ServedModel, most_served
from tandem import model_ids
from tandem.config import ApiKey, Tier
from tandem.runtime.request_id import current_request_id
from tandem.store import Message, Role

log = logging.getLogger(__name__)
AUTO = ("", "auto")
MODEL_WAIT_S = 3.0  # a chat that just started hears the workers' heartbeats within a second or two


class UnknownModel(NotFound):
    """A named model that is neither served nor configured."""

    default_code = "unknown_model"


class Decision(str, Enum):
    SMALL = "small"
    LARGE = "large"
    PICKED = "picked"  # the model the (paid) user named
    CONVERSATION = "conversation"  # the model the conversation is on


class DecidedBy(str, Enum):
    CLASSIFIER = "classifier"
    FALLBACK = "fallback"  # the fallback rule: no classifier, or it raised, was slow or busy
    USER = "user"
    CONVERSATION = "conversation"
    SINGLE_MODEL = "single_model"  # no small model is configured
    QUOTA_FALLBACK = "quota_fallback"  # the user's quota could not afford the decided model: the small one answers


@dataclass(frozen=True)
class Route:
    model: ServedModel
    decision: Decision
    decided_by: DecidedBy
    score: float | None = None  # the classifier's, when it answered
    instead_of: str = ""  # the model decided on, when another one answers (none of its workers served, or took, it; or the quota)

    def answered_by(self, model: str) -> Route:
        """The route of a reply the router gave to `model` (another pool's when the decided one is
        down or full; a version of the decided name when the rollout chose it)."""
        if model == self.model.name or model_ids.name_of(model) == self.model.name:
            return self
        return replace(self, instead_of=self.instead_of or self.model.name)

    def as_dict(self) -> dict[str, object]:
        """As the `meta` event's `route`."""
        out: dict[str, object] = {"decision": self.decision.value, "decided_by": self.decided_by.value, "score": self.score}
        if self.instead_of:
            out["instead_of"] = self.instead_of
        return out


def conversation_model(messages: Sequence[Message]) -> str:
    """The model a conversation is on: the one its newest user turn was routed to ("" for none),
    with the version that answered it where the turn names only the model (turn_model)."""
    user_turn = next((m for m in reversed(messages) if m.role == Role.USER and m.model), None)
    return "" if user_turn is None else turn_model(user_turn, messages)


def turn_model(user_turn: Message, messages: Sequence[Message]) -> str:
    """The model a user turn was routed to; when it names a model without a version (stored before
    the routers' rollout chose one), the version its newest answer of that name came from."""
    if model_ids.is_versioned(user_turn.model):
        return user_turn.model
    answers = (m for m in reversed(messages) if m.role == Role.ASSISTANT and m.parent_seq == user_turn.seq)
    versioned = (m.model for m in answers if model_ids.is_versioned(m.model) and model_ids.name_of(m.model) == user_turn.model)
    return next(versioned, user_turn.model)


@dataclass(frozen=True)
class RoutingConfig:
    """The two models' served ids (an empty large one: the most served; an empty small one: auto
    is the large one), the classifier's threshold and the fallback rule's length."""

    large_model: str = ""
    small_model: str = ""
    difficulty_threshold: float = 0.5
    fallback_small_max_tokens: int = 200

    @classmethod
    def of(cls, config: ChatConfig) -> RoutingConfig:
        return cls(config.large_model, config.small_model, config.difficulty_threshold, config.fallback_small_max_tokens)


class ModelRouter:
    """Decides the model of each message from the served `models`, by `difficulty` (None: the
    fallback rule decides)."""

    def __init__(self, config: RoutingConfig, models: ModelsView, difficulty: DifficultyJudge | None = None) -> None:
        self._config = config
        self._models = models
        self._difficulty = difficulty

    async def route(self, user: ApiKey, requested: str, text: str, count_tokens: Callable[[str], int], on_model: str = "") -> Route:
        """The route for a message `text` from `user`, who asked for `requested`, in a conversation on
        the model `on_model` ("" for a new one or none). `count_tokens` counts for the fallback rule.
        Raises UnknownModel for a name nothing serves or configures, Unavailable when no model is served."""
        served = await self._served_soon()
        small = self._config.small_model
        large = self._config.large_model or _name(most_served(served.values(), excluding=small))
        if requested not in AUTO and _lookup(served, requested) is None and requested not in (large, small):
            raise UnknownModel(f"model {requested!r} is not served; GET /v1/models lists those that are")
        if requested not in AUTO and user.tier != Tier.FREE:
            # A bare name picks the model, not a version: the conversation's version of it stays.
            same = on_model and not model_ids.is_versioned(requested) and model_ids.name_of(on_model) == requested
            decided = _Decided(on_model if same else requested, Decision.PICKED, DecidedBy.USER)
        elif on_model and (_lookup(served, on_model) is not None or on_model in (large, small)):
            decided = _Decided(on_model, Decision.CONVERSATION, DecidedBy.CONVERSATION)
        elif not small or small == large:
            decided = _Decided(large, Decision.LARGE, DecidedBy.SINGLE_MODEL)
        else:
            decided = await self._by_difficulty(text, count_tokens, large, small)
        model = _served_or_other(served, decided.name, large, small)
        instead_of = decided.name if model.name != decided.name else ""
        route = Route(model, decided.decision, decided.decided_by, decided.score, instead_of)
        record_route(route, user)
        return route

    def quota_fallback(self, route: Route) -> Route | None:
        """Where a message on `route` goes when the user's quota cannot afford it: the small model,
        decided by quota_fallback (recorded once it is taken: record_route); None when no small
        model is configured or served."""
        small = self._config.small_model
        model = self._models.models().get(small) if small else None
        if model is None:
            return None
        instead_of = route.model.name if route.model.name != small else ""
        return Route(model, Decision.SMALL, DecidedBy.QUOTA_FALLBACK, route.score, instead_of)

    async def _served_soon(self) -> dict[str, ServedModel]:
        """The served models; right after a start, when none is known yet, after waiting for one."""
        if not self._models.models():
            await self._models.resolve_soon("auto", MODEL_WAIT_S)
        return self._models.models()

    async def _by_difficulty(self, text: str, count_tokens: Callable[[str], int], large: str, small: str) -> _Decided:
        scored = await self._difficulty.score(text) if self._difficulty is not None else Scored(None, NONE)
        if scored.score is not None:
            metrics.DIFFICULTY_SCORES.observe(scored.score)
            if scored.score >= self._config.difficulty_threshold:
                return _Decided(large, Decision.LARGE, DecidedBy.CLASSIFIER, scored.score)
            return _Decided(small, Decision.SMALL, DecidedBy.CLASSIFIER, scored.score)
        metrics.DIFFICULTY_FALLBACKS.labels(reason=scored.why_not).inc()
        num_tokens = await asyncio.to_thread(count_tokens, text)
        if fallback_is_small(text, num_tokens, self._config.fallback_small_max_tokens):
            return _Decided(small, Decision.SMALL, DecidedBy.FALLBACK)
        return _Decided(large, Decision.LARGE, DecidedBy.FALLBACK)


class _Decided(NamedTuple):
    name: str
    decision: Decision
    decided_by: DecidedBy
    score: float | None = None


def _served_or_other(served: dict[str, ServedModel], name: str, large: str, small: str) -> ServedModel:
    """`name` when a worker serves it (or its name, for a version none serves), else the other of
    large and small, else the most served."""
    other = small if model_ids.name_of(name) == large else large
    model = _lookup(served, name) or served.get(other) or most_served(served.values())
    if model is None:
        raise Unavailable("no model is being served yet; try again shortly", code="no_workers", retry_after_s=2.0)
    return model


def _lookup(served: dict[str, ServedModel], name: str) -> ServedModel | None:
    """The served model `name` stands for: itself, or a version's name when none serves the version."""
    return served.get(name) or served.get(model_ids.name_of(name))


def _name(model: ServedModel | None) -> str:
    return "" if model is None else model.name


def record_route(route: Route, user: ApiKey) -> None:
    """Counts and logs a decision (a quota fallback is a second one for its message)."""
    metrics.MODEL_ROUTES.labels(model=route.model.name, decided_by=route.decided_by.value).inc()
    score = "-" if route.score is None else f"{route.score:.3f}"
    why_not = "quota" if route.decided_by is DecidedBy.QUOTA_FALLBACK else "not served"
    instead = f" instead of {route.instead_of} ({why_not})" if route.instead_of else ""
    log.info(
        "request %s: model %s%s: %s, decided by %s (score %s, tier %s)",
        current_request_id(),
        route.model.name,
        instead,
        route.decision.value,
        route.decided_by.value,
        score,
        user.tier.value,
    )
