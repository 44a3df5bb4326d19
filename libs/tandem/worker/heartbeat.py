"""A worker's heartbeat: the runtime's base heartbeat plus the worker's model, its gRPC address,
the replies it holds (the relay continues elsewhere a stalled reply nobody claims) and, once the
engine runs, the engine's load (what the router places replies by)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tandem.engine.engine import EngineStats
from tandem.engine.sequence import Lane
from tandem.kernels.metadata import BLOCK_SIZE
from tandem.v1.common_pb2 import LaneCounts
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat


@dataclass(frozen=True)
class EngineLoad:
    """What a worker's heartbeat says about its engine."""

    stats: EngineStats
    num_total_blocks: int
    max_model_len: int
    mean_step_time_ms: float
    last_kv_event_id: int = 0  # the last KV event published
    prefill_tokens_per_s: float = 0.0  # measured recently; 0 until measured
    estimated_wait_s: float = 0.0  # before a free request offered now starts computing; 0 until a rate is measured
    free_ttft_target_s: float = 0.0  # the wait it allows a free request (its target, scaled for its device)


class WorkerHeartbeats:
    """Builds each heartbeat of one worker; `engine_load` is None until the engine is ready;
    `claimed_reply_ids` every reply the worker will finish."""

    def __init__(
        self,
        model_name: str,
        grpc_address: str,
        engine_load: Callable[[], EngineLoad | None],
        claimed_reply_ids: Callable[[], Iterable[str]],
    ) -> None:
        self._model_name = model_name
        self._grpc_address = grpc_address
        self._engine_load = engine_load
        self._claimed_reply_ids = claimed_reply_ids

    def build(self, base: ServiceHeartbeat) -> WorkerHeartbeat:
        heartbeat = WorkerHeartbeat(service=base, model=self._model_name, grpc_address=self._grpc_address, kv_block_size=BLOCK_SIZE)
        heartbeat.reply_ids.extend(self._claimed_reply_ids())
        load = self._engine_load()
        if load is not None:
            s = load.stats.scheduler
            heartbeat.is_engine_ready = True
            heartbeat.max_model_len = load.max_model_len
            heartbeat.kv_blocks_free = s.num_free_blocks
            heartbeat.kv_blocks_total = load.num_total_blocks
            heartbeat.running.CopyFrom(_lanes(s.num_running))
            heartbeat.waiting.CopyFrom(_lanes(s.num_waiting))
            heartbeat.queued_prefill_tokens = s.num_queued_prefill_tokens
            heartbeat.step_time_ms = load.mean_step_time_ms
            heartbeat.kv_event_id = load.last_kv_event_id
            heartbeat.prefill_tokens_per_s = load.prefill_tokens_per_s
            heartbeat.estimated_wait_s = load.estimated_wait_s
            heartbeat.free_ttft_target_s = load.free_ttft_target_s
        return heartbeat


def _lanes(counts: dict[Lane, int]) -> LaneCounts:
    return LaneCounts(paid=counts[Lane.PAID], free=counts[Lane.FREE], background=counts[Lane.BACKGROUND])
