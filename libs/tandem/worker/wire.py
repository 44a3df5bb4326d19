"""Between the wire (our protobufs) and the engine's own types, in one place for every worker."""

from __future__ import annotations

import sys
import time

from tandem.bus.events import final_event, now_ms
from tandem.engine.engine import EngineFacts, Request, RequestOutput
from tandem.engine.sequence import FinishReason, Lane, SamplingOptions
from tandem.v1 import common_pb2
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.kv_handoff_pb2 import KvLayout
from tandem.v1.tokens_pb2 import TokenEvent, TokenLogprob

LANES = {common_pb2.LANE_PAID: Lane.PAID, common_pb2.LANE_BACKGROUND: Lane.BACKGROUND}  # anything else: FREE
FINISH: dict[FinishReason, common_pb2.FinishReason] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


def engine_request(reply_id: str, request: GenerateRequest) -> Request:
    """The engine's view of a GenerateRequest, arrived now; raises ValueError for bad sampling."""
    p = request.sampling
    sampling = SamplingOptions(
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        top_logprobs=p.top_logprobs if p.HasField("top_logprobs") else None,
        grammar=p.grammar,
    )
    return Request(
        reply_id,
        tuple(request.prompt_token_ids),
        sampling,
        lane=LANES.get(request.lane, Lane.FREE),
        tenant=request.tenant or request.user_id,
        user_id=request.user_id,
        num_public_prefix_tokens=min(request.public_prefix_tokens, len(request.prompt_token_ids)),
        generated_token_ids=tuple(request.generated_token_ids),
        arrival_s=time.monotonic(),  # its wait counts from here, the step in flight included
    )


def token_event(output: RequestOutput, seq: int, worker_id: str, epoch: int, model: str = "") -> TokenEvent:
    """The reply's event `seq` from its owner `epoch`: this output's token, its logprobs where the
    request asks, and text, and the finish, stop reason and usage of its last, which names the
    served `model` that wrote the reply."""
    token_id = output.new_token_ids[0] if output.new_token_ids else None
    if output.finish_reason is not None:
        usage = common_pb2.Usage(
            input_tokens=output.num_prompt_tokens, cached_tokens=output.num_cached_tokens, output_tokens=output.num_output_tokens
        )
        finish = FINISH[output.finish_reason]
        event = final_event(output.request_id, seq, finish, worker_id=worker_id, text=output.text, token_id=token_id, usage=usage)
        event.epoch = epoch
        event.model = model
        if output.stop_reason is not None:
            event.stop_reason = output.stop_reason.value
    else:
        event = TokenEvent(
            reply_id=output.request_id, seq=seq, text=output.text, worker_id=worker_id, produced_unix_ms=now_ms(), epoch=epoch
        )
        if token_id is not None:
            event.token_id = token_id
    if output.logprobs is not None:
        event.logprob = output.logprobs.logprob
        event.top_logprobs.extend(TokenLogprob(token_id=t, logprob=lp) for t, lp in output.logprobs.top)
    return event


def kv_layout(facts: EngineFacts, model_name: str) -> KvLayout:
    shape = facts.kv_shape
    return KvLayout(
        model=model_name,
        dtype=str(facts.kv_dtype).removeprefix("torch."),
        block_size=shape.block_size,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        byte_order=sys.byteorder,
        tensor_parallel_size=facts.tensor_parallel_size,
    )
