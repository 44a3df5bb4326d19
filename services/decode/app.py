"""The decode worker: continuous batching on its engine, replies assigned by the router (each
prefilled locally for now; KV handoffs from prefill workers come next), every new token
published as a TokenEvent on tandem.v1.tokens.<reply_id>."""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from fastapi import FastAPI
from nats.aio.client import Client
from nats.aio.msg import Msg

from tandem.bus import BadMessage, decode, encode, subjects
from tandem.config import Settings
from tandem.engine.engine import Engine, EngineConfig, Request, RequestOutput
from tandem.engine.sequence import FinishReason, Lane, SamplingOptions
from tandem.engine_thread import EngineThread
from tandem.kernels import select_attention
from tandem.models.loader import default_dtype, load_model
from tandem.v1 import common_pb2
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import GenerateRequest, Refusal
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.worker import EngineLoad, build_worker

ROLE = "decode"
log = logging.getLogger(__name__)

LANES = {common_pb2.LANE_PAID: Lane.PAID, common_pb2.LANE_BACKGROUND: Lane.BACKGROUND}  # anything else: FREE
FINISH = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def engine_request(reply_id: str, request: GenerateRequest) -> Request:
    """The engine's view of a GenerateRequest; raises ValueError for bad sampling."""
    p = request.sampling
    sampling = SamplingOptions(
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
    )
    return Request(
        reply_id,
        tuple(request.prompt_token_ids),
        sampling,
        lane=LANES.get(request.lane, Lane.FREE),
        tenant=request.tenant or request.user_id,
        num_public_prefix_tokens=min(request.public_prefix_tokens, len(request.prompt_token_ids)),
    )


class DecodeWorker:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._worker = build_worker(ROLE, settings, self._engine_load)
        self._engine: EngineThread | None = None
        self._next_seq: dict[str, int] = {}
        self._outbox: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self._publisher: asyncio.Task[None] | None = None

    def app(self) -> FastAPI:
        self._worker.runtime.add_check("engine", self._is_engine_ready)
        self._worker.runtime.bus.on_connect(self._subscribe)
        return self._worker.app(on_start=self._start, on_stop=self._stop)

    # -- lifecycle ------------------------------------------------------------------------------

    async def _start(self) -> None:
        self._engine = EngineThread(self._build_engine, self._outbox.put_nowait, asyncio.get_running_loop())
        self._engine.start()
        self._publisher = asyncio.create_task(self._publish_outputs(), name="publish-tokens")

    async def _stop(self) -> None:
        if self._engine is not None:
            await asyncio.to_thread(self._engine.stop)
        if self._publisher is not None:
            self._publisher.cancel()

    def _build_engine(self) -> Engine:
        dtype = default_dtype("cpu") if self._settings.dtype == "auto" else DTYPES[self._settings.dtype]
        loaded = load_model(self._worker.model.path, dtype, "cpu", select_attention("cpu"))
        log.info("engine ready: %s, %s", self._worker.model.name, dtype)
        return Engine(loaded, EngineConfig(kv_cache_mib=self._settings.kv_cache_mib))

    async def _is_engine_ready(self) -> bool:
        return self._engine is not None and self._engine.is_ready

    def _engine_load(self) -> EngineLoad | None:
        if self._engine is None or not self._engine.is_ready or self._engine.latest_stats is None:
            return None
        engine = self._engine.engine
        assert engine is not None
        stats = self._engine.latest_stats
        mean_step_ms = 1000 * (stats.prefill_time_s + stats.decode_time_s) / max(1, stats.num_steps)
        return EngineLoad(stats, engine.kv_shape.num_blocks, engine.loaded.config.max_position_embeddings, mean_step_ms)

    # -- NATS -----------------------------------------------------------------------------------

    async def _subscribe(self, client: Client) -> None:
        await client.subscribe(subjects.assign(self._worker.runtime.config.instance_id), cb=self._on_assign)
        await client.subscribe(subjects.CANCEL_ALL, cb=self._on_cancel)

    async def _on_assign(self, msg: Msg) -> None:
        await msg.respond(encode(await self._accept(msg.data)))

    async def _accept(self, data: bytes) -> AssignmentReply:
        def refuse(reason: str, message: str, retry_after_s: float = 0.0) -> AssignmentReply:
            return AssignmentReply(refused=Refusal(reason=reason, message=message, retry_after_s=retry_after_s))

        try:
            assignment = decode(data, Assignment)
            subjects.tokens(assignment.reply_id)  # a reply id must be a valid subject token
            request = engine_request(assignment.reply_id, assignment.request)
        except (BadMessage, ValueError) as exc:
            return refuse("bad_request", str(exc))
        if self._worker.runtime.is_draining:
            return refuse("draining", "this worker is draining", retry_after_s=1.0)
        if self._engine is None or not self._engine.is_ready:
            return refuse("loading", "this worker's engine is still loading its model", retry_after_s=2.0)
        if assignment.reply_id in self._next_seq:
            return AssignmentReply(accepted=True)  # a retried assignment: it is already running here
        try:
            await self._engine.add(request)
        except ValueError as exc:  # PromptTooLong, EmptyPrompt
            return refuse("prompt_too_long" if "prompt of" in str(exc) else "bad_request", str(exc))
        self._next_seq[assignment.reply_id] = assignment.first_seq or 1
        return AssignmentReply(accepted=True)

    async def _on_cancel(self, msg: Msg) -> None:
        reply_id = subjects.reply_id_of(msg.subject)
        if reply_id in self._next_seq and self._engine is not None:
            self._engine.abort(reply_id)

    async def _publish_outputs(self) -> None:
        client = await self._worker.runtime.bus.wait_connected()
        while True:
            for output in await self._outbox.get():
                seq = self._next_seq.get(output.request_id)
                if seq is None:
                    continue
                await client.publish(subjects.tokens(output.request_id), encode(self._token_event(output, seq)))
                if output.is_finished:
                    del self._next_seq[output.request_id]
                else:
                    self._next_seq[output.request_id] = seq + 1

    def _token_event(self, output: RequestOutput, seq: int) -> TokenEvent:
        event = TokenEvent(
            reply_id=output.request_id,
            seq=seq,
            text=output.text,
            worker_id=self._worker.runtime.config.instance_id,
            produced_unix_ms=int(time.time() * 1000),
        )
        if output.new_token_ids:
            event.token_id = output.new_token_ids[0]
        if output.finish_reason is not None:
            event.finish = FINISH[output.finish_reason]
            event.usage.input_tokens = output.num_prompt_tokens
            event.usage.cached_tokens = output.num_cached_tokens
            event.usage.output_tokens = output.num_output_tokens
        return event


def build_app(settings: Settings) -> FastAPI:
    return DecodeWorker(settings).app()
