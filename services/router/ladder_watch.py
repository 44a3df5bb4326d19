"""The router's observation loop: every `ladder_interval_s` it reads the large model's decode
pool from the heartbeats, moves the ladder, sets the rung gauge and publishes a LadderStatus on
`tandem.v1.ladder` (the chat's GET /v1/status shows the newest)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.router import metrics
from services.router.admission import large_model
from services.router.ladder import FleetReading, Ladder, read_fleet
from services.router.pools import ModelPools
from services.router.workers import WorkerRegistry
from tandem.bus import encode, subjects
from tandem.bus.events import now_ms
from tandem.v1.worker_pb2 import LadderStatus

DECODE_ROLE = "decode"
log = logging.getLogger(__name__)

# Puts bytes on a subject (the NATS client's publish in production).
Publish = Callable[[str, bytes], Awaitable[None]]


def ladder_status(router_id: str, ladder: Ladder, reading: FleetReading) -> LadderStatus:
    return LadderStatus(
        router_id=router_id,
        rung=ladder.rung,
        busyness=reading.busyness,
        kv_occupancy=reading.kv_occupancy,
        queue_pressure=reading.queue_pressure,
        sent_unix_ms=now_ms(),
        interval_s=ladder.interval_s,
    )


class LadderWatch:
    def __init__(
        self,
        router_id: str,
        ladder: Ladder,
        workers: WorkerRegistry,
        free_target_s: float,
        publish: Publish,
        pools: ModelPools = ModelPools(),
    ) -> None:
        self._router_id = router_id
        self._pools = pools  # the large model's pool is the one watched
        self._ladder = ladder
        self._workers = workers
        self._free_target_s = free_target_s
        self._publish = publish

    async def observe_once(self) -> bool:
        """One observation when one is due; False when it is not yet."""
        workers = self._workers.workers(DECODE_ROLE)
        rung_before = self._ladder.rung
        reading = read_fleet(workers, large_model(workers, self._pools), self._free_target_s)
        if not self._ladder.observe(reading):
            return False
        metrics.LADDER_RUNG.set(self._ladder.rung)
        metrics.LADDER_BUSYNESS.set(reading.busyness)
        if self._ladder.rung != rung_before:
            log.warning(
                "overload ladder: rung %d -> %d (busyness %.2f: KV %.2f, queue wait %.2f)",
                rung_before,
                self._ladder.rung,
                reading.busyness,
                reading.kv_occupancy,
                reading.queue_pressure,
            )
        await self._publish(subjects.LADDER, encode(ladder_status(self._router_id, self._ladder, reading)))
        return True

    async def run(self) -> None:
        """Observes until cancelled (the router's stop); a failed publish is logged, never fatal."""
        while True:
            await asyncio.sleep(self._ladder.seconds_until_due())
            try:
                await self.observe_once()
            except Exception:  # the ladder must keep observing whatever one round met
                log.exception("the overload ladder's observation failed")
                await asyncio.sleep(self._ladder.interval_s)
