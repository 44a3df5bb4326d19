"""Heartbeats of decode workers as the router's registry holds them (shared by the router tests)."""

from __future__ import annotations

from services.router.workers import LiveWorker
from tandem.v1.common_pb2 import LaneCounts
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat

MODEL = "SmolLM2-135M-Instruct"


def decode_worker(
    instance_id: str,
    *,
    model: str = MODEL,
    num_running: int = 0,
    num_waiting: int = 0,
    queued_prefill_tokens: int = 0,
    is_ready: bool = True,
    is_engine_ready: bool = True,
    max_model_len: int = 8192,
    num_assigned: int = 0,
    estimated_wait_s: float = 0.0,
    free_ttft_target_s: float = 0.0,
    kv_blocks_free: int = 0,
    kv_blocks_total: int = 0,
) -> LiveWorker:
    heartbeat = WorkerHeartbeat(
        service=ServiceHeartbeat(role="decode", instance_id=instance_id, is_ready=is_ready),
        model=model,
        running=LaneCounts(paid=num_running),
        waiting=LaneCounts(free=num_waiting),
        queued_prefill_tokens=queued_prefill_tokens,
        max_model_len=max_model_len,
        is_engine_ready=is_engine_ready,
        estimated_wait_s=estimated_wait_s,
        free_ttft_target_s=free_ttft_target_s,
        kv_blocks_free=kv_blocks_free,
        kv_blocks_total=kv_blocks_total,
    )
    return LiveWorker(heartbeat, num_assigned=num_assigned)


def request(num_prompt_tokens: int = 8, *, model: str = "auto", max_tokens: int = 16, **fields) -> GenerateRequest:
    message = GenerateRequest(model=model, prompt_token_ids=list(range(1, num_prompt_tokens + 1)), **fields)
    message.sampling.max_tokens = max_tokens
    return message
