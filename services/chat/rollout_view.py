"""The model rollouts as the routers apply them, for `GET /v1/status`: every router publishes a
RolloutStatus on `tandem.v1.rollout` at each reload of its rollout file (services/router/rollout.py);
the newest fresh one is shown, and a candidate any fresh router rolled back is shown rolled back
(the routers adopt one another's rollbacks, so they agree within one interval)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.aio.msg import Msg

from tandem.bus import validate
from tandem.v1.worker_pb2 import ModelRollout, RolloutStatus, VersionWindow

FRESH_INTERVALS = 3
MIN_FRESH_S = 1.0


@dataclass(frozen=True)
class _Heard:
    status: RolloutStatus
    at_s: float


class RolloutView:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heard: dict[str, _Heard] = {}  # router id -> its newest status

    async def on_status(self, msg: Msg) -> None:
        try:
            self.observe(validate.rollout_status(msg.data))
        except validate.Invalid as exc:
            validate.drop("rollout_status", msg.subject, exc)

    def observe(self, status: RolloutStatus) -> None:
        self._heard[status.router_id] = _Heard(status, self._clock())

    def current(self) -> list[ModelRollout] | None:
        """Each model's rollout from the newest fresh status, rolled back where any fresh router
        rolled it back; None when no router has reported lately."""
        now_s = self._clock()
        for router_id in [r for r, h in self._heard.items() if now_s - h.at_s > max(MIN_FRESH_S, FRESH_INTERVALS * h.status.interval_s)]:
            del self._heard[router_id]
        if not self._heard:
            return None
        statuses = sorted((h.status for h in self._heard.values()), key=lambda s: s.sent_unix_ms)
        rolled_back = {(m.model, m.candidate): m for s in statuses for m in s.models if m.rolled_back}
        return [rolled_back.get((m.model, m.candidate), m) for m in statuses[-1].models]


def rollout_body(rollouts: list[ModelRollout] | None) -> list[dict[str, object]] | None:
    """As `/v1/status`'s `rollout`: None when no router reported one lately."""
    if rollouts is None:
        return None
    return [_rollout(m) for m in rollouts]


def _rollout(m: ModelRollout) -> dict[str, object]:
    out: dict[str, object] = {
        "model": m.model,
        "stable": m.stable,
        "candidate": m.candidate or None,
        "candidate_percent": m.candidate_percent,
        "configured_percent": m.configured_percent,
        "shadow_percent": m.shadow_percent,
        "rolled_back": m.rolled_back,
        "window": {"stable": _window(m.stable_window), "candidate": _window(m.candidate_window)},
    }
    if m.rolled_back:
        out["rollback_reason"] = m.rollback_reason
        out["rolled_back_at"] = datetime.fromtimestamp(m.rolled_back_unix_ms / 1000, UTC).isoformat().replace("+00:00", "Z")
    return out


def _window(w: VersionWindow) -> dict[str, object]:
    return {"replies": w.replies, "errors": w.errors, "ttft_p95_s": round(w.ttft_p95_s, 4) if w.ttft_p95_s else None}
