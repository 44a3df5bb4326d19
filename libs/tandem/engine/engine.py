"""The engine: requests in, token streams out. One `step()` is the whole algorithm:

    plan = scheduler.schedule()                            # who computes what this step
    sampled = runner.execute(plan)                         # one batched forward, then sampling (and logprobs)
    texts, stopped_ids = each sampled token's text delta and stop-string hits
    result = scheduler.update(plan, sampled, stopped_ids)  # what finished, what was handed off
    outputs: one per aborted and per sampled sequence

plus the text of each reply (detokenization, stop strings) and the disaggregation hooks: run a
request prefill-only and export its blocks; reserve blocks, fill them and import a sequence.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.engine.admission_rate import AdmissionRate
from tandem.engine.block_pool import CachedBlock, KvEvent
from tandem.engine.decode_graphs import SIZES, DecodeGraphs
from tandem.engine.engine_config import DEFAULT_BATCHED_TOKENS, DEFAULT_UNPAID_TOKENS, EngineConfig
from tandem.engine.kv_cache_manager import ImportReservation, KvCacheManager
from tandem.engine.logprobs import TokenLogprobs
from tandem.engine.memory_budget import KvPlan, plan_kv_cache
from tandem.engine.prefill_rate import PrefillRate
from tandem.engine.reply_text import ReplyText
from tandem.engine.runner import Runner, Sampled
from tandem.engine.sampling import Sampler
from tandem.engine.scheduler import QueueWait, Scheduler, SchedulerConfig, SchedulerStats, StepPlan, UpdateResult
from tandem.engine.sequence import FinishReason, Lane, SamplingOptions, Sequence, StopReason
from tandem.kernels.metadata import KvCacheShape
from tandem.models.llama import StepCut
from tandem.models.loader import LoadedModel
from tandem.structured_output import GrammarCompiler, InvalidGrammar

__all__ = [
    "DEFAULT_BATCHED_TOKENS",  # defined with EngineConfig
    "DEFAULT_UNPAID_TOKENS",
    "Engine",
    "EngineConfig",  # defined in engine_config.py, which memory_budget.py reads too
    "EngineFacts",
    "EngineStats",
    "Handoff",
    "ImportReservation",  # defined with the KV cache manager, which makes and frees it
    "InvalidGrammar",  # defined with the grammar specs (tandem.structured_output), which the chat checks too
    "KvCacheAllocator",
    "QueueWait",
    "Request",
    "RequestOutput",
    "TokenIdOutOfRange",
    "TokenLogprobs",  # defined in logprobs.py, which computes them
]


class TokenIdOutOfRange(ValueError):
    """A request names a token id the model's vocabulary lacks (its embedding lookup would fail)."""


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions = SamplingOptions()
    lane: Lane = Lane.FREE
    tenant: str = ""
    user_id: str = ""  # within a lane, users are admitted round-robin
    num_public_prefix_tokens: int = 0
    # A continuation: tokens of this reply generated (and streamed) before, by a worker that died
    # or a handoff that failed. They follow the prompt, count as output, and are not streamed again.
    generated_token_ids: tuple[int, ...] = ()
    # time.monotonic() when it reached the engine's owner (a worker), so its queue wait and time to
    # first token count the step it waited for there; 0: when it is added.
    arrival_s: float = 0.0


@dataclass(frozen=True)
class Handoff:
    """A prefill-only request whose first token is sampled: its KV blocks await export.
    Block i holds tokens [16i, 16i+16) of the prompt; release it with Engine.release()."""

    block_ids: tuple[int, ...]
    num_computed_tokens: int


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    text: str  # the delta released by this step
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    handoff: Handoff | None = None
    logprobs: TokenLogprobs | None = None  # of new_token_ids' token, when the request asks
    stop_reason: StopReason | None = None  # a finished one's, where its finish reason does not say why

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    scheduler: SchedulerStats
    num_steps: int
    num_prefill_tokens: int  # computed since start
    num_decode_tokens: int
    prefill_time_s: float  # step time, split by each step's share of prefill and decode tokens
    decode_time_s: float
    prefill_tokens_per_s: float = 0.0  # prompt tokens per second a queued prefill gets now (engine.prefill_rate); 0 until measured
    num_generated_tokens: int = 0  # tokens sampled since start (a prefill's first token included)
    # How fast each lane's waiting queue drains (engine.admission_rate); a lane is absent until measured.
    admissions_per_s: dict[Lane, float] = field(default_factory=dict)
    num_cut_steps: int = 0  # steps cut short for a paid arrival (cut_step) since start, not in num_steps

    @property
    def kv_cache_usage(self) -> float:
        """The share of the KV pool's blocks held by requests (0-1); blocks kept only by the prefix
        cache are free to reuse and do not count."""
        s = self.scheduler
        return s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0

    @property
    def kv_cache_prefix_cached(self) -> float:
        """The share of the KV pool's blocks holding a cached prefix, held by a request or free to
        reuse (0-1): how much reusable KV the worker keeps, which stays after its replies end."""
        s = self.scheduler
        return s.num_cached_blocks / s.num_blocks if s.num_blocks else 0.0


@dataclass
class _Counters:
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    num_generated_tokens: int = 0
    num_cut_steps: int = 0


@dataclass(frozen=True)
class EngineFacts:
    """What an engine's configuration fixes at load, for whoever drives it from elsewhere."""

    kv_shape: KvCacheShape
    kv_cache_shape: tuple[int, ...]  # the whole cache tensor's (managed blocks, and a graphs' scratch block)
    kv_dtype: torch.dtype
    max_position_embeddings: int  # the longest sequence served: the resolved max_model_len (memory_budget.py), not the model's window
    tensor_parallel_size: int = 1  # ranks, each with a KV cache of kv_cache_shape holding its heads


# Allocates the zeroed KV cache (shape, dtype, device); the engine's default is torch.zeros.
KvCacheAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


class Engine:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig = EngineConfig(), allocate_kv_cache: KvCacheAllocator | None = None
    ) -> None:
        """`allocate_kv_cache`: where the KV cache lives (an engine process puts it in memory its
        worker shares, tandem.worker.engine_process); zeroed, of the shape and dtype asked."""
        self.loaded = loaded
        self.config = config
        if loaded.model.tp.size > 1 and loaded.model.tp.rank == 0:  # the other ranks build theirs alike (rank_follower.py)
            loaded.model.tp.broadcast(config)
        model_config = loaded.model.config  # this rank's: its KV heads under tensor parallelism
        parameter = next(loaded.model.parameters())
        cache_dtype = config.kv_cache_dtype or parameter.dtype
        # How many blocks, and the longest sequence served (memory_budget.py; a TP peer rank calls it too).
        self.kv_plan: KvPlan = plan_kv_cache(loaded.model, config, cache_dtype, parameter.device)
        num_blocks = self.kv_plan.num_blocks
        self.kv_shape = KvCacheShape(
            num_blocks, model_config.num_layers, config.block_size, model_config.num_kv_heads, model_config.head_dim
        )
        # No CUDA graphs under tensor parallelism yet: every rank would capture its step with the all-reduces.
        is_graphed = parameter.device.type == "cuda" and not config.enforce_eager and loaded.model.tp.size == 1
        # Graphed decode steps pad their batch with rows in a scratch block past the managed ones.
        cache_shape = (num_blocks + int(is_graphed), *self.kv_shape.as_tuple()[1:])
        if allocate_kv_cache is None:
            kv_cache = torch.zeros(cache_shape, dtype=cache_dtype, device=parameter.device)
        else:
            kv_cache = allocate_kv_cache(cache_shape, cache_dtype, parameter.device)
        self.kv = KvCacheManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.batched_tokens_on(parameter.device.type),
                max_num_prefill_only_tokens=config.prefill_only_tokens_on(parameter.device.type),
                max_num_seqs=config.max_num_seqs,
                num_reserved_blocks=config.num_reserved_blocks,
                max_num_unpaid_tokens=config.max_num_unpaid_tokens or DEFAULT_UNPAID_TOKENS.get(parameter.device.type),
                max_model_len=self.kv_plan.max_model_len,
                repetition_stop=config.repetition_stop,
            ),
            self.kv,
        )
        graphs = None
        if is_graphed:
            max_context = min(self.kv_plan.max_model_len, num_blocks * config.block_size)
            graphs = DecodeGraphs(loaded.model, kv_cache, config.block_size, min(config.max_num_seqs, SIZES[-1]), max_context, capture=True)
        self.runner = Runner(loaded.model, kv_cache, config.block_size, Sampler(), graphs)
        self._replies: dict[str, ReplyText] = {}  # the text of every request still scheduled
        self._exports: dict[str, Sequence] = {}  # handed off, blocks held until release()
        self._counters = _Counters()
        self._cut = threading.Event()  # cut_step asked for it
        self._prefill_rate = PrefillRate(self.scheduler.config.max_num_batched_tokens)
        self._admission_rate = AdmissionRate()
        self._grammars = GrammarCompiler(loaded.tokenizer.backend.to_str, loaded.config.vocab_size, loaded.eos_token_ids)

    # -- requests -------------------------------------------------------------------------------

    def add(self, request: Request, prefill_only: bool = False) -> None:
        """Queues a request; raises PromptTooLong / EmptyPrompt / TokenIdOutOfRange (ValueErrors) for
        one that can never run."""
        self.scheduler.add(self._sequence(request, is_prefill_only=prefill_only), arrival_s=request.arrival_s)
        self._replies[request.request_id] = self._reply_text(request)

    def check(self, request: Request) -> None:
        """Raises PromptTooLong / EmptyPrompt / TokenIdOutOfRange (ValueErrors) for a request that
        could never run. Safe from another thread: it reads only the configuration, so a worker can answer an
        assignment without waiting for the step in progress."""
        self.scheduler.check(self._sequence(request))

    def abort(self, request_id: str) -> bool:
        """Cancels a request; its blocks are freed at the next step."""
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def cut_step(self) -> None:
        """A paid request was just queued (call from any thread): the step in progress, when it
        computes free or background rows on a CPU, ends at its next layer (a decode step's, at
        its next call of a few layers: models/packed.py) without a result, and the next step is
        the paid request's. The cut step's work is lost, and is
        done again; a paid arrival no longer waits out a step of free work."""
        self._cut.set()

    def step(self) -> list[RequestOutput]:
        started_s = time.perf_counter()
        self._cut.clear()  # a paid request queued before this step is in its plan
        plan = self.scheduler.schedule()
        model = self.loaded.model.model
        # A step cut on rank 0 alone would leave the other ranks of a tensor-parallel engine in its collectives.
        can_cut = self.config.cut_unpaid_steps and plan.num_unpaid_tokens and model.tp.size == 1
        model.should_cut = self._cut.is_set if can_cut else None
        try:
            sampled = self.runner.execute(plan)
        except StepCut:  # its sequences keep their blocks and compute the same tokens again
            self._counters.num_cut_steps += 1
            # its admissions stand: they count in how fast the queues drain
            self._admission_rate.add_step(
                plan.num_admitted, time.perf_counter() - started_s, self.scheduler.waiting_lanes(), time.monotonic()
            )
            return [self._cancelled(seq) for seq in plan.aborted]
        finally:
            model.should_cut = None
        texts = {seq_id: self._replies[seq_id].add(token_id) for seq_id, token_id in sampled.token_ids.items()}
        stopped_ids = {seq_id for seq_id in sampled.token_ids if self._replies[seq_id].has_hit_stop}
        result = self.scheduler.update(plan, sampled.token_ids, stopped_ids)
        outputs = self._outputs(plan, sampled, texts, result)
        self._count(plan, len(sampled.token_ids), time.perf_counter() - started_s)
        return outputs

    def generate(self, requests: list[Request]) -> dict[str, list[RequestOutput]]:
        """Runs the requests to completion (a convenience for tools and tests)."""
        for request in requests:
            self.add(request)
        streams: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        while self.has_work():
            for output in self.step():
                streams[output.request_id].append(output)
        return streams

    def drain_kv_events(self) -> list[KvEvent]:
        return self.kv.drain_events()

    def cached_blocks(self) -> list[CachedBlock]:
        """Every block the prefix cache holds now (a worker's full KV state)."""
        return self.kv.cached_blocks()

    def stats(self) -> EngineStats:
        c = self._counters
        scheduler = self.scheduler.stats()
        num_decodes = sum(scheduler.num_running.values())  # a row of each step each (a prefilling one soon)
        prefill_rate = self._prefill_rate.prefill_tokens_per_s(num_decodes)
        return EngineStats(
            scheduler,
            c.num_steps,
            c.num_prefill_tokens,
            c.num_decode_tokens,
            c.prefill_time_s,
            c.decode_time_s,
            prefill_rate,
            c.num_generated_tokens,
            {lane: rate for lane in Lane if (rate := self._admission_rate.per_s(lane, time.monotonic())) is not None},
            c.num_cut_steps,
        )

    def drain_queue_waits(self) -> list[QueueWait]:
        """How long each request first admitted since the last drain waited for it."""
        return self.scheduler.drain_queue_waits()

    # -- disaggregation hooks -------------------------------------------------------------------

    def facts(self) -> EngineFacts:
        kv_cache = self.runner.kv_cache
        return EngineFacts(self.kv_shape, tuple(kv_cache.shape), kv_cache.dtype, self.kv_plan.max_model_len, self.loaded.model.tp.size)

    def close(self) -> None:
        """Ends the other ranks' part of a tensor-parallel engine (nothing to do with one rank)."""
        self.runner.stop_peers()

    def block_view(self, block_id: int) -> torch.Tensor:
        """One block's K and V for every layer: a contiguous view (num_layers, 2, block_size,
        num_kv_heads, head_dim) to send from, or to receive into."""
        return self.runner.kv_cache[block_id]

    def discard(self, request_id: str) -> bool:
        """Drops a request wherever it is: aborted if still scheduled, released if exported."""
        if request_id in self._exports:
            self.release(request_id)
            return True
        return self.abort(request_id)

    def release(self, request_id: str) -> None:
        """Frees an exported prefill's blocks (their content stays in the prefix cache)."""
        seq = self._exports.pop(request_id)
        self.kv.free(seq)

    def reserve_import(self, request: Request, num_blocks: int) -> ImportReservation:
        """Holds `num_blocks` blocks for `request`'s tokens (prompt and generated ones): the cached
        prefix, then fresh blocks for the rest; raises NoFreeBlocks when they do not fit."""
        return self.kv.reserve_import(self._sequence(request), num_blocks)

    def cancel_import(self, reservation: ImportReservation) -> None:
        self.kv.cancel_import(reservation)

    def import_sequence(self, request: Request, reservation: ImportReservation, first_token_id: int, num_cached_tokens: int = 0) -> None:
        """Continues a request prefilled elsewhere: the reservation's blocks (from reserve_import,
        the new ones filled by the transfer) hold the KV of all its tokens, and its next token was
        sampled (and streamed) by the prefill side."""
        seq = self._sequence(request)
        if not 0 <= first_token_id < self.loaded.config.vocab_size:
            raise TokenIdOutOfRange(f"{request.request_id}: first token id {first_token_id} is outside the vocabulary")
        seq.attach_computed_blocks(reservation.block_ids, reservation.cached_block_hashes, seq.num_tokens)
        seq.append_token(first_token_id)
        reply = self._reply_text(request)
        reply.add(first_token_id)  # its text was already sent by the prefill worker
        self.scheduler.adopt(seq, num_cached_tokens)
        self._replies[request.request_id] = reply

    # -- internals ------------------------------------------------------------------------------

    def _sequence(self, request: Request, is_prefill_only: bool = False) -> Sequence:
        """The request's sequence; raises TokenIdOutOfRange for a token the model lacks and
        InvalidGrammar for a grammar spec that does not compile, so every door into the engine
        (add, check, reserve, import) refuses it before a step could fail. A continuation's
        grammar is advanced over the tokens generated before, as they are appended."""
        vocab_size = self.loaded.config.vocab_size
        for name, token_ids in (("prompt", request.prompt_token_ids), ("generated", request.generated_token_ids)):
            bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise TokenIdOutOfRange(f"{request.request_id}: {name} token id {bad} is outside the vocabulary (0 to {vocab_size - 1})")
        seq = Sequence(
            request.request_id,
            request.prompt_token_ids,
            request.sampling,
            lane=request.lane,
            tenant=request.tenant,
            user_id=request.user_id,
            num_public_prefix_tokens=request.num_public_prefix_tokens,
            eos_token_ids=() if request.sampling.ignore_eos else self.loaded.eos_token_ids,
            is_prefill_only=is_prefill_only,
            grammar=self._grammars.matcher(request.sampling.grammar) if request.sampling.grammar else None,
        )
        for token_id in request.generated_token_ids:
            seq.append_token(token_id)
        return seq

    def _reply_text(self, request: Request) -> ReplyText:
        """The reply's text so far: a continuation's generated tokens were streamed already."""
        text = ReplyText(self.loaded.tokenizer, request.prompt_token_ids, request.sampling.stop, request.sampling.min_tokens)
        for token_id in request.generated_token_ids:
            text.add(token_id)
        return text

    def _outputs(self, plan: StepPlan, sampled: Sampled, texts: dict[str, str], result: UpdateResult) -> list[RequestOutput]:
        """One output per aborted sequence, then one per sampled sequence in the plan's order;
        a finished reply's text ends with what its detokenizer held back."""
        for seq in result.finished:
            texts[seq.seq_id] += self._replies.pop(seq.seq_id).finish()
        handoffs = {seq.seq_id: self._export(seq) for seq in result.handed_off}
        outputs = [self._cancelled(seq) for seq in plan.aborted]
        for seq in plan.sampled_seqs:
            token = (sampled.token_ids[seq.seq_id],)
            outputs.append(self._output(seq, token, texts[seq.seq_id], handoffs.get(seq.seq_id), sampled.logprobs.get(seq.seq_id)))
        return outputs

    def _export(self, seq: Sequence) -> Handoff:
        """Keeps a handed-off prefill's blocks until release() (or discard()) frees them."""
        del self._replies[seq.seq_id]
        self._exports[seq.seq_id] = seq
        return Handoff(tuple(seq.block_table), seq.num_computed_tokens)

    def _cancelled(self, seq: Sequence) -> RequestOutput:
        reply = self._replies.pop(seq.seq_id, None)
        return self._output(seq, (), reply.finish() if reply is not None else "")

    def _output(
        self, seq: Sequence, token_ids: tuple[int, ...], text: str, handoff: Handoff | None = None, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        return RequestOutput(
            seq.seq_id,
            token_ids,
            text,
            seq.finish_reason,
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            seq.num_output_tokens,
            handoff,
            logprobs,
            seq.stop_reason,
        )

    def _count(self, plan: StepPlan, num_sampled: int, elapsed_s: float) -> None:
        num_prefill_tokens, num_decode_tokens = plan.num_prefill_tokens, plan.num_decode_tokens
        c = self._counters
        c.num_steps += 1
        c.num_generated_tokens += num_sampled
        c.num_prefill_tokens += num_prefill_tokens
        c.num_decode_tokens += num_decode_tokens
        # A step that replays generated tokens (a continuation's) computes each as a decode over its
        # whole context: its time says nothing of a prompt's prefill rate (when replays took a
        # forward each, a drill's continuations made the rate read far too low, refusing work
        # that would have started at once).
        if not plan.num_replayed_tokens:
            self._prefill_rate.add_step(num_prefill_tokens, elapsed_s, num_decode_tokens)
        self._admission_rate.add_step(plan.num_admitted, elapsed_s, self.scheduler.waiting_lanes(), time.monotonic())
        num_tokens = num_prefill_tokens + num_decode_tokens
        if num_tokens:
            c.prefill_time_s += elapsed_s * num_prefill_tokens / num_tokens
            c.decode_time_s += elapsed_s * num_decode_tokens / num_tokens
