"""`GET /v1/status`: public (no API key) and free of secrets: how loaded the service is, as the
routers' overload ladder sees it, the models being served, and their rollouts
(services.chat.rollout_view).

Every router publishes a LadderStatus on `tandem.v1.ladder` at each observation. With several
routers the highest rung among the statuses still fresh (heard within three of its intervals)
is shown; "unknown" when none has reported lately."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from fastapi import APIRouter
from nats.aio.msg import Msg

from services.chat.models_view import ModelsView
from services.chat.rollout_view import RolloutView, rollout_body
from tandem.bus import validate
from tandem.v1.worker_pb2 import LadderStatus

FRESH_INTERVALS = 3  # a status is current for this many of its router's intervals
MIN_FRESH_S = 1.0
RUNG_MEANINGS = (
    "normal",
    "busy: background work is paused; free messages go to the small model when one is served",
    "very busy: free answers are shortened",
    "at capacity: free messages that cannot start soon are refused with a time to retry",
)


@dataclass(frozen=True)
class _Heard:
    status: LadderStatus
    at_s: float


class LadderView:
    """The newest LadderStatus of each router, and the one that counts now."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heard: dict[str, _Heard] = {}  # router id -> its newest status

    async def on_status(self, msg: Msg) -> None:
        try:
            self.observe(validate.ladder_status(msg.data))
        except validate.Invalid as exc:
            validate.drop("ladder_status", msg.subject, exc)

    def observe(self, status: LadderStatus) -> None:
        self._heard[status.router_id] = _Heard(status, self._clock())

    def current(self) -> LadderStatus | None:
        """The highest rung (then the busiest) among fresh statuses; None when none is fresh."""
        now_s = self._clock()
        for router_id in [r for r, h in self._heard.items() if now_s - h.at_s > _fresh_s(h.status)]:
            del self._heard[router_id]  # a router that stopped reporting
        fresh = [h.status for h in self._heard.values()]
        return max(fresh, key=lambda s: (s.rung, s.busyness), default=None)


def _fresh_s(status: LadderStatus) -> float:
    return max(MIN_FRESH_S, FRESH_INTERVALS * status.interval_s)


def status_body(status: LadderStatus | None, models: list[str]) -> dict[str, object]:
    if status is None:
        return {"status": "unknown", "rung": None, "busyness": None, "observed_at": None, "models": models}
    rung = min(status.rung, len(RUNG_MEANINGS) - 1)
    return {
        "status": "normal" if rung == 0 else "degraded",
        "rung": status.rung,
        "meaning": RUNG_MEANINGS[rung],
        "busyness": round(status.busyness, 3),
        "observed_at": datetime.fromtimestamp(status.sent_unix_ms / 1000, UTC).isoformat().replace("+00:00", "Z"),
        "models": models,
    }


def status_router(ladder: LadderView, models: ModelsView, rollouts: RolloutView) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/status")
    async def service_status() -> dict[str, object]:
        return status_body(ladder.current(), sorted(models.models())) | {"rollout": rollout_body(rollouts.current())}

    return router
