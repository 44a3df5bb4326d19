"""The large and the small model's pools, and when a request moves from one to the other.

A request for the small model goes to the large one when no small worker takes work now (none
live, all loading, not ready or draining: "down") or when every small worker is too busy to start
it within its lane's target ("full"). The reverse, the small model answering a request for the
large one, is for free traffic only and only when the overload ladder allows it: the ladder's
rung 1 already sends free traffic to the small model, and a large pool that is down allows it
too. Paid requests are never moved to the small model. Without both models named (settings
large_model and small_model) nothing moves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.router import metrics
from services.router.placement import can_serve, serves_name
from services.router.workers import LiveWorker
from tandem import model_ids
from tandem.config import Settings
from tandem.v1.common_pb2 import LANE_FREE

DOWN = "down"  # no worker of the model takes work now
FULL = "full"  # every worker of the model refused the request's lane at the door


@dataclass(frozen=True)
class ModelPools:
    large: str = ""  # the large model's name (any version; a full id pins one); empty: the name most workers serve
    small: str = ""  # the small model's; empty: none

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelPools:
        return cls(large=settings.large_model, small=settings.small_model)

    @property
    def has_two(self) -> bool:
        return bool(self.large and self.small) and model_ids.name_of(self.large) != model_ids.name_of(self.small)

    @property
    def names(self) -> frozenset[str]:
        """The models named by settings: known to the router even while none of their workers is live."""
        return frozenset(model_ids.name_of(name) for name in (self.large, self.small) if name)

    def when_down(self, model: str, lane: int, workers: Sequence[LiveWorker]) -> str | None:
        """The other pool's model (as the settings name it: the caller picks its version) for a
        request of `model` that no worker can serve now while the other pool can (small to large
        for every lane; large to small for free requests); None when it stays."""
        other = self._other(model, lane)
        if other is None or any(can_serve(w, model) for w in workers):
            return None
        if not any(serves_name(w, model_ids.name_of(other)) for w in workers):
            return None
        return other

    def when_full(self, model: str) -> str | None:
        """The large model for a small-model request (any version) that every small worker is too
        busy for (the reverse is the overload ladder's to decide); None when it stays."""
        return self.large if self.has_two and model_ids.name_of(model) == model_ids.name_of(self.small) else None

    def _other(self, model: str, lane: int) -> str | None:
        if not self.has_two:
            return None
        name = model_ids.name_of(model)
        if name == model_ids.name_of(self.small):
            return self.large
        if name == model_ids.name_of(self.large) and lane == LANE_FREE:
            return self.small
        return None


def count_fallback(from_model: str, to_model: str, why: str) -> None:
    metrics.MODEL_FALLBACKS.labels(from_model=from_model, to_model=to_model, why=why).inc()
