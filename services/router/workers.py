"""The router's live view of workers, fed by their heartbeats, plus what this router handed them
since: a heartbeat is up to an interval old, so without that a burst would all land on the
worker that looked idle when the burst began."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.v1.worker_pb2 import WorkerHeartbeat

WORKER_ROLES = ("prefill", "decode")  # the roles whose heartbeats the router follows


@dataclass(frozen=True)
class LiveWorker:
    """One live worker as the router sees it: its last heartbeat and the replies this router
    assigned it after that heartbeat arrived (not yet in the worker's own counts)."""

    heartbeat: WorkerHeartbeat
    num_assigned: int = 0
    num_assigned_prompt_tokens: int = 0

    @property
    def instance_id(self) -> str:
        return self.heartbeat.service.instance_id

    @property
    def model(self) -> str:
        return self.heartbeat.model

    @property
    def is_serving(self) -> bool:
        """Ready as a service and its engine takes work (the model is loaded, the window known)."""
        heartbeat = self.heartbeat
        return heartbeat.service.is_ready and heartbeat.is_engine_ready and heartbeat.max_model_len > 0


@dataclass
class _Seen:
    heartbeat: WorkerHeartbeat
    at_s: float
    num_assigned: int = 0
    num_assigned_prompt_tokens: int = 0


class WorkerRegistry:
    """A worker is live while its last heartbeat is younger than `expiry_s`; `on_forget` hears
    of each worker that falls silent (checked on every heartbeat and every listing)."""

    def __init__(
        self,
        expiry_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        on_forget: Callable[[str], None] = lambda instance_id: None,
    ) -> None:
        self._expiry_s = expiry_s
        self._clock = clock
        self._on_forget = on_forget
        self._seen: dict[str, _Seen] = {}

    def observe(self, heartbeat: WorkerHeartbeat) -> None:
        # A fresh heartbeat counts what it was assigned before, so this router's tally restarts.
        self._seen[heartbeat.service.instance_id] = _Seen(heartbeat, self._clock())
        self._forget_silent()

    def note_assigned(self, instance_id: str, num_prompt_tokens: int) -> None:
        """The worker accepted a reply from this router; count it until its next heartbeat."""
        seen = self._seen.get(instance_id)
        if seen is not None:
            seen.num_assigned += 1
            seen.num_assigned_prompt_tokens += num_prompt_tokens

    def live(self, role: str | None = None) -> list[WorkerHeartbeat]:
        """Heartbeats of live workers that say they are ready."""
        return [w.heartbeat for w in self.workers(role) if w.heartbeat.service.is_ready]

    def workers(self, role: str | None = None) -> list[LiveWorker]:
        """Every live worker of `role`, ready or not (starting, loading, draining)."""
        self._forget_silent()
        return [
            LiveWorker(s.heartbeat, s.num_assigned, s.num_assigned_prompt_tokens)
            for s in self._seen.values()
            if role is None or s.heartbeat.service.role == role
        ]

    def _forget_silent(self) -> None:
        now_s = self._clock()
        for instance_id in [i for i, s in self._seen.items() if now_s - s.at_s > self._expiry_s]:
            del self._seen[instance_id]
            self._on_forget(instance_id)
