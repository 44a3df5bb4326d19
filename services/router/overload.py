"""What each rung of the overload ladder does to a request, at admission. Paid is never degraded.

- rung >= 1: background requests are refused ("background work pauses"), and a free request for
  the large model goes to another model when the workers serve one (the small model);
- rung >= 2: free answers are capped at `free_max_tokens`;
- rung 3: a free request that no worker expects to start within `start_deadline_s` (by the
  heartbeats' `estimated_wait_s`; the deadline scaled for each worker's device like its targets)
  is refused.
Refusals are "overloaded" with a time to retry: a rung lasts at least one observation."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from services.router import metrics
from services.router.ladder import Ladder
from services.router.lanes import OVERLOADED, WaitTargets
from services.router.placement import can_serve
from services.router.workers import LiveWorker
from tandem import model_ids
from tandem.v1.common_pb2 import LANE_BACKGROUND, LANE_PAID
from tandem.v1.generate_pb2 import GenerateRequest, Refusal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OverloadConfig:
    free_max_tokens: int = 300
    start_deadline_s: float = 2.0  # on a GPU: each worker's is scaled as its targets are
    targets: WaitTargets = WaitTargets()


@dataclass(frozen=True)
class Degraded:
    """The model that answers (the small one, from rung 1) after the request was capped in place."""

    model: str


class Overload:
    def __init__(self, ladder: Ladder, config: OverloadConfig = OverloadConfig()) -> None:
        self._ladder = ladder
        self._config = config

    def apply(
        self, request: GenerateRequest, lane: int, model: str, large_model: str, workers: Sequence[LiveWorker], small_model: str = ""
    ) -> Degraded | Refusal:
        """The request under the current rung: refused, or admitted for a model (its max_tokens
        capped in place). `workers`: every live decode worker. `small_model`: the one free
        requests go to from rung 1 (settings small_model); empty: the most served other one."""
        rung = self._ladder.rung
        if rung == 0 or lane == LANE_PAID:
            return Degraded(model)
        retry_after_s = self._ladder.interval_s
        if lane == LANE_BACKGROUND:
            return self._refuse(rung, "background work is paused while the service is busy", retry_after_s)
        if model_ids.name_of(model) == model_ids.name_of(large_model):
            model = self._small_model(model, workers, small_model)
        if rung >= 2 and request.sampling.max_tokens > self._config.free_max_tokens:
            request.sampling.max_tokens = self._config.free_max_tokens
            metrics.LADDER_FREE_CAPPED.inc()
        if rung >= 3:
            # (expected wait, this worker's deadline) of the worker that would start it soonest past its deadline
            waits = [
                (w.heartbeat.estimated_wait_s, self._config.start_deadline_s * self._config.targets.scale_of(w))
                for w in workers
                if can_serve(w, model)
            ]
            wait_s, deadline_s = min(waits, key=lambda pair: pair[0] - pair[1], default=(0.0, 0.0))
            if wait_s > deadline_s:
                message = (
                    f"the service is at capacity: free messages that cannot start within {deadline_s:g} s "
                    f"are refused for now (the soonest start is in {wait_s:.0f} s); paid plans are served first"
                )
                return self._refuse(rung, message, max(retry_after_s, wait_s - deadline_s))
        return Degraded(model)

    def _small_model(self, model: str, workers: Sequence[LiveWorker], small_model: str) -> str:
        """Another model the workers serve now, for a free request of the large `model`
        (`small_model` when named, else the most served name, then by name; its version is the
        caller's to pick); `model` itself when there is none."""
        large_name, small_name = model_ids.name_of(model), model_ids.name_of(small_model)
        counts: dict[str, int] = {}
        for worker in workers:
            name = model_ids.name_of(worker.model)
            if name != large_name and worker.is_serving and name == (small_name or name):
                counts[name] = counts.get(name, 0) + 1
        if not counts:
            metrics.LADDER_SMALL_MODEL.labels(outcome="none_served").inc()
            return model
        metrics.LADDER_SMALL_MODEL.labels(outcome="routed").inc()
        return small_model if small_model else min(counts, key=lambda name: (-counts[name], name))

    def _refuse(self, rung: int, message: str, retry_after_s: float) -> Refusal:
        return Refusal(reason=OVERLOADED, message=f"{message} (overload rung {rung})", retry_after_s=retry_after_s)
