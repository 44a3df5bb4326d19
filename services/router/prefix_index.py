"""Which KV blocks each worker holds (block hashes by worker id), kept from the workers' KV events.

A worker numbers its events 1, 2, 3, ... and the index applies them in that order. On a gap (an
event id that is not the last one + 1: a lost message, a restarted worker, a router that joined
late) or when heartbeats keep showing a kv_event_id the events never reached, it asks that worker
for its full state and replaces the worker's entries with it. Events that arrive while the state
request is in flight wait; those newer than the state are applied after it.

The index may lag a worker by a message or two; placement treats it as a hint, never a promise
(the worker's engine looks its own prefix cache up again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from services.router import metrics
from tandem.bus import Bus, encode, subjects, validate
from tandem.v1.kv_pb2 import KvEvent, KvState, KvStateRequest
from tandem.v1.worker_pb2 import WorkerHeartbeat

log = logging.getLogger(__name__)

# Asks one worker for its full state; raises when it gives none.
FetchState = Callable[[str], Awaitable[KvState]]


def nats_fetch_state(bus: Bus, timeout_s: float) -> FetchState:
    """The production FetchState: NATS request/reply on the worker's kv state subject."""

    async def fetch(worker_id: str) -> KvState:
        msg = await bus.client.request(subjects.kv_state(worker_id), encode(KvStateRequest()), timeout=timeout_s)
        try:
            return validate.kv_state(msg.data, worker_id)
        except validate.Invalid as exc:
            validate.drop("kv_state", msg.subject, exc)
            raise

    return fetch


@dataclass
class _Worker:
    block_hashes: set[int] = field(default_factory=set)
    last_event_id: int = 0
    started_unix_ms: int = 0  # of the process whose events these are, once a heartbeat told
    # The kv_event_id of a heartbeat that was ahead of last_event_id; still ahead at the next
    # heartbeat means events were lost (a single heartbeat may just overtake events in flight).
    awaited_event_id: int | None = None
    resync: asyncio.Task[None] | None = None  # a state request in flight
    held_back: list[KvEvent] = field(default_factory=list)  # events that arrived during it


class PrefixIndex:
    def __init__(self, fetch_state: FetchState) -> None:
        self._fetch_state = fetch_state
        self._workers: dict[str, _Worker] = {}

    # -- queries --------------------------------------------------------------------------------

    def num_prefix_blocks(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` the worker holds, by its events."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        num_blocks = 0
        for block_hash in block_hashes:
            if block_hash not in worker.block_hashes:
                break
            num_blocks += 1
        return num_blocks

    def last_event_id(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return worker.last_event_id if worker is not None else 0

    def worker_ids(self) -> frozenset[str]:
        return frozenset(self._workers)

    async def wait_resynced(self) -> None:
        """Until no state request is in flight (each ends within its timeout): a router that stops
        waits for them before it closes its NATS connection."""
        while tasks := [w.resync for w in self._workers.values() if w.resync is not None]:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- feeding --------------------------------------------------------------------------------

    def apply(self, event: KvEvent) -> None:
        """One KV event as it arrives: applied if it is the next one, else the start of a resync."""
        worker = self._workers.setdefault(event.worker_id, _Worker())
        if worker.resync is not None:
            worker.held_back.append(event)
            return
        if event.event_id != worker.last_event_id + 1:
            log.info("KV events of %s jump from %d to %d; asking for its state", event.worker_id, worker.last_event_id, event.event_id)
            worker.held_back.append(event)
            self._start_resync(event.worker_id, worker, "gap")
            return
        self._apply_change(worker, event)

    def observe_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        """A restarted worker (a new start time) starts over; one whose published events stay
        ahead of those seen gets a state request."""
        worker_id = heartbeat.service.instance_id
        started_unix_ms = heartbeat.service.started_unix_ms
        worker = self._workers.get(worker_id)
        if worker is not None and worker.started_unix_ms and started_unix_ms != worker.started_unix_ms:
            log.info("%s restarted; its KV entries are dropped", worker_id)
            self.forget(worker_id)
            worker = None
        if worker is None:
            if heartbeat.kv_event_id == 0:
                return  # nothing cached there, and nothing to remember yet
            worker = self._workers.setdefault(worker_id, _Worker())
        worker.started_unix_ms = started_unix_ms
        if worker.resync is not None:
            return
        if worker.awaited_event_id is not None and worker.last_event_id < worker.awaited_event_id:
            log.info(
                "%s published KV event %d, the last seen is %d; asking for its state",
                worker_id,
                heartbeat.kv_event_id,
                worker.last_event_id,
            )
            self._start_resync(worker_id, worker, "behind")
            return
        worker.awaited_event_id = heartbeat.kv_event_id if heartbeat.kv_event_id > worker.last_event_id else None

    def forget(self, worker_id: str) -> None:
        """Drops a worker's entries (it left the live view, or restarted)."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        if worker.resync is not None:
            worker.resync.cancel()

    # -- internals ------------------------------------------------------------------------------

    def _apply_change(self, worker: _Worker, event: KvEvent) -> None:
        change = event.WhichOneof("change")
        if change == "stored":
            worker.block_hashes.update(block.block_hash for block in event.stored.blocks)
        elif change == "removed":
            worker.block_hashes.difference_update(event.removed.block_hashes)
        elif change == "cleared":
            worker.block_hashes.clear()
        worker.last_event_id = event.event_id

    def _start_resync(self, worker_id: str, worker: _Worker, reason: str) -> None:
        metrics.KV_STATE_REQUESTS.labels(reason=reason).inc()
        worker.awaited_event_id = None
        answer = self._fetch_state(worker_id)  # asked now; awaited by the task
        worker.resync = asyncio.create_task(self._resync(worker_id, worker, answer), name=f"kv-state:{worker_id}")

    async def _resync(self, worker_id: str, worker: _Worker, answer: Awaitable[KvState]) -> None:
        try:
            state = await answer
        except Exception as exc:
            # The next event (a gap again) or heartbeat (still ahead) asks anew.
            log.warning("no KV state from %s (%s); its entries may be stale", worker_id, exc or type(exc).__name__)
            worker.resync = None
            worker.held_back.clear()
            return
        if self._workers.get(worker_id) is not worker:
            return  # forgotten meanwhile
        worker.resync = None
        worker.block_hashes = {block.block_hash for block in state.blocks}
        worker.last_event_id = state.event_id
        held_back, worker.held_back = worker.held_back, []
        for event in held_back:
            if event.event_id > state.event_id:  # older ones are in the state already
                self.apply(event)
