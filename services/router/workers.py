"""The router's live view of workers, fed by their heartbeats."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.v1.worker_pb2 import WorkerHeartbeat


@dataclass
class _Seen:
    heartbeat: WorkerHeartbeat
    at_s: float


class WorkerRegistry:
    """A worker is live while its last heartbeat is younger than `expiry_s`."""

    def __init__(self, expiry_s: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._expiry_s = expiry_s
        self._clock = clock
        self._seen: dict[str, _Seen] = {}

    def observe(self, heartbeat: WorkerHeartbeat) -> None:
        self._seen[heartbeat.service.instance_id] = _Seen(heartbeat, self._clock())

    def live(self, role: str | None = None) -> list[WorkerHeartbeat]:
        now_s = self._clock()
        for instance_id in [i for i, s in self._seen.items() if now_s - s.at_s > self._expiry_s]:
            del self._seen[instance_id]
        return [
            s.heartbeat
            for s in self._seen.values()
            if s.heartbeat.service.is_ready and (role is None or s.heartbeat.service.role == role)
        ]
