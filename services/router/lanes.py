"""Lanes at the router: paid, free and background requests placed by what each lane may wait.

The router holds no queue of its own (each request is placed as it arrives); the queue a request
waits in is its worker's, which serves paid first. What the router adds is where a request goes
and whether it is taken at all:

- A worker's heartbeat says how long a FREE request offered now would wait to start
  (`estimated_wait_s`). It is a hint: free and background requests try workers within the free
  lane's target first. Paid requests skip it (they go ahead of that queue).
- A worker's refusal ("queue_full", with `retry_after_s`) is the truth. The router remembers it
  until then, offers that worker the lane's requests last, and when every worker of the model
  refused the lane lately, refuses the request at the door ("overloaded") with the soonest time
  any of them gave.

Each worker states in its heartbeat the wait it allows a free request (`free_ttft_target_s`: its
target, scaled for its device), and the router judges that worker's `estimated_wait_s` against
it. For a worker that does not state one, the router takes its own TANDEM_DEVICE as the fleet's:
only "cuda" gives the GPU targets; "cpu" and "auto" scale them by cpu_ttft_scale. Erring long is
the safe side: the workers' refusals still hold the line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.router.workers import LiveWorker
from tandem.config import Settings
from tandem.v1.common_pb2 import LANE_BACKGROUND, LANE_FREE, LANE_PAID
from tandem.v1.generate_pb2 import GenerateRequest, Refusal

LANE_NAMES: dict[int, str] = {LANE_PAID: "paid", LANE_FREE: "free", LANE_BACKGROUND: "background"}
OVERLOADED = "overloaded"  # the router's refusal: no worker can start the request in time
# How long a refusal is remembered when the worker gave no time, and at most.
MIN_HOLD_S = 0.5
MAX_HOLD_S = 30.0


def lane_of(request: GenerateRequest) -> int:
    """The request's lane; an unset one is free (as the workers take it)."""
    return request.lane if request.lane in LANE_NAMES else LANE_FREE


@dataclass(frozen=True)
class WaitTargets:
    """The longest expected wait to start, per lane (background waits like free)."""

    paid_s: float = 1.0
    free_s: float = 2.0
    scale: float = 1.0  # the CPU factor already applied (other deadlines are scaled alike)

    @classmethod
    def from_settings(cls, settings: Settings) -> WaitTargets:
        scale = 1.0 if settings.device == "cuda" else settings.cpu_ttft_scale
        return cls(paid_s=settings.ttft_target_paid_s * scale, free_s=settings.ttft_target_free_s * scale, scale=scale)

    def for_lane(self, lane: int) -> float:
        return self.paid_s if lane == LANE_PAID else self.free_s

    def free_s_of(self, worker: LiveWorker) -> float:
        """The free lane's target on `worker`: the one its heartbeat states, else the fleet's."""
        return worker.heartbeat.free_ttft_target_s or self.free_s

    def scale_of(self, worker: LiveWorker) -> float:
        """The factor `worker` applies to the settings' targets (1 on a GPU)."""
        return self.scale * self.free_s_of(worker) / self.free_s


class LaneRefusals:
    """Workers' "queue_full" refusals, remembered per worker and lane until their retry time.
    A lane refused also refuses every lane behind it (a worker with no room for paid has none
    for free)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until_s: dict[str, dict[int, float]] = {}  # worker id -> lane -> refused until

    def note(self, worker_id: str, lane: int, retry_after_s: float) -> None:
        hold_s = min(MAX_HOLD_S, max(MIN_HOLD_S, retry_after_s))
        lanes = self._until_s.setdefault(worker_id, {})
        lanes[lane] = max(lanes.get(lane, 0.0), self._clock() + hold_s)

    def eta_s(self, worker_id: str, lane: int) -> float:
        """Seconds until the worker said it would take the lane's requests again; 0: it takes them."""
        now_s = self._clock()
        lanes = self._until_s.get(worker_id, {})
        return max([0.0] + [until_s - now_s for refused, until_s in lanes.items() if refused <= lane])

    def is_full(self, worker_id: str, lane: int) -> bool:
        return self.eta_s(worker_id, lane) > 0

    def forget(self, worker_id: str) -> None:
        self._until_s.pop(worker_id, None)


def order_for_lane(ranked: Sequence[LiveWorker], lane: int, targets: WaitTargets, refusals: LaneRefusals) -> list[LiveWorker]:
    """`ranked` (best first) reordered for the lane, stably: workers that refused the lane lately
    go last; for free and background, workers whose heartbeat expects a wait over the free
    target go after those within it."""

    def key(worker: LiveWorker) -> tuple[bool, bool]:
        is_over_hint = lane != LANE_PAID and worker.heartbeat.estimated_wait_s > targets.free_s_of(worker)
        return refusals.is_full(worker.instance_id, lane), is_over_hint

    return sorted(ranked, key=key)


def door_refusal(lane: int, model: str, serving: Sequence[LiveWorker], refusals: LaneRefusals, targets: WaitTargets) -> Refusal | None:
    """ "overloaded" when no worker serving the model can start the request within its lane's
    target: each refused the lane lately, or (free and background) its heartbeat expects a longer
    wait. The retry time is the soonest any of them expects room; None when one may take it."""
    etas_s = [_eta_s(w, lane, refusals, targets) for w in serving]
    if not etas_s or min(etas_s) <= 0:
        return None
    soonest_s = min(etas_s)
    message = (
        f"every worker serving {model} is too busy to start a {LANE_NAMES[lane]} request within its target; "
        f"the soonest expects room in {soonest_s:.1f} s"
    )
    return Refusal(reason=OVERLOADED, message=message, retry_after_s=soonest_s)


def _eta_s(worker: LiveWorker, lane: int, refusals: LaneRefusals, targets: WaitTargets) -> float:
    """Seconds until the worker could start a request of the lane in time (0: now)."""
    # The heartbeat's wait is a free request's; a paid one goes ahead of that queue.
    over_target_s = 0.0 if lane == LANE_PAID else worker.heartbeat.estimated_wait_s - targets.free_s_of(worker)
    return max(refusals.eta_s(worker.instance_id, lane), over_target_s)
