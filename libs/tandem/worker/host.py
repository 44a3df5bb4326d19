"""A worker's engine behind a named async API. The engine steps in a process of its own on a CPU
(engine_process.py: it never waits for the loop's GIL) or on a thread of its own (thread.py, on a
GPU or with TANDEM_ENGINE_PROCESS=false), so the loop stays free for NATS, gRPC and UCX; the host is
the only door to it, and its callers never see which. The host also publishes each reply's outputs
as TokenEvents on JetStream (contiguous sequence numbers per reply, the assignment's owner epoch),
its prefix cache's changes as KV events (and its full state on request), applies cancels, keeps the
replies this worker holds (its heartbeat claims them), reports the engine's load and judges whether
a request offered now would start within its lane's TTFT target (admission.py). Decode and prefill
workers both build one.

A host that cannot go on (its engine died, its token events cannot be published) is failed:
`failure` says why, it is not ready, it claims no reply, and `wait_failed` wakes the worker, which
exits so that its supervisor restarts it.

Changes that nobody needs to wait for (an add, an abort, a release) are queued and return at once:
the engine takes them between two steps, and a step can take seconds on a CPU."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from tandem.bus import Bus, subjects, validate
from tandem.bus.cancels import RecentCancels
from tandem.bus.token_stream import DEFAULT_MAX_AGE_S
from tandem.config import Settings
from tandem.engine.block_pool import CachedBlock, KvEvent
from tandem.engine.engine import Engine, EngineConfig, EngineStats, ImportReservation, KvCacheAllocator, QueueWait, Request, RequestOutput
from tandem.engine.sequence import Lane
from tandem.kernels import select_attention
from tandem.models.files import ModelFile
from tandem.models.loader import load_model, resolve_device, resolve_dtype, resolve_kv_cache_dtype
from tandem.v1.kv_handoff_pb2 import KvLayout
from tandem.v1.kv_pb2 import KvState
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.worker import metrics
from tandem.worker.admission import Overloaded, QueueState, TtftTargets, queue_verdict
from tandem.worker.engine_metrics import EngineMetrics
from tandem.worker.engine_process import EngineProcess
from tandem.worker.heartbeat import EngineLoad
from tandem.worker.kv_events import KvEventPublisher
from tandem.worker.replies import HeldReplies, ReplyStream
from tandem.worker.thread import EngineDead, EngineThread
from tandem.worker.token_publisher import BusProbe, CannotPublish, open_token_stream, publish_event, server_answers
from tandem.worker.wire import kv_layout, token_event

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """What a worker's engine is built from."""

    model: ModelFile
    device: str
    dtype: torch.dtype
    engine: EngineConfig
    torch_threads: int = 0  # 0: torch's default (one per core of the machine)
    engine_process: bool = False  # the engine steps in a process of its own (engine_process.py), else on a thread
    log_level: str = "INFO"  # the engine process's

    @classmethod
    def from_settings(cls, settings: Settings, model: ModelFile, role: str = "decode") -> EngineSpec:
        """Resolves the device now, so "cuda" without a GPU fails at start (StartupError). A prefill
        worker's engine captures no CUDA graphs: they serve decode steps, which it leaves to others."""
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        engine = EngineConfig(
            kv_cache_mib=settings.kv_cache_mib,
            kv_cache_dtype=None if settings.kv_cache_dtype == "auto" else resolve_kv_cache_dtype(settings.kv_cache_dtype, dtype, device),
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_unpaid_tokens=settings.max_num_unpaid_batched_tokens,
            enforce_eager=settings.enforce_eager or role == "prefill",
        )
        # One thread per CPU of the process's affinity unless set: torch counts the machine's cores.
        torch_threads = settings.torch_threads or len(settings.cpus)
        # An engine process shares its KV cache through a memfd: a CPU's cache, on Linux.
        engine_process = settings.engine_process and device == "cpu" and hasattr(os, "memfd_create")
        return cls(model, device, dtype, engine, torch_threads, engine_process, settings.log_level)


def build_engine(spec: EngineSpec, allocate_kv_cache: KvCacheAllocator | None = None) -> Engine:
    """Where the engine steps (its thread, or its process): torch's thread count is set here."""
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    loaded = load_model(spec.model.path, spec.dtype, spec.device, select_attention(spec.device), spec.model.quantization)
    log.info(
        "engine ready: %s, %s (quantization %s) on %s with %d torch threads",
        spec.model.name,
        spec.dtype,
        spec.model.quantization,
        spec.device,
        torch.get_num_threads(),
    )
    return Engine(loaded, spec.engine, allocate_kv_cache)


class WorkerFailed(Exception):
    """This worker failed (see EngineHost.failure) while the caller waited on its engine."""


class EngineHost:
    def __init__(
        self,
        spec: EngineSpec,
        worker_id: str,
        targets: TtftTargets,
        token_stream_max_age_s: float = DEFAULT_MAX_AGE_S,
        engine_metrics: EngineMetrics | None = None,
    ) -> None:
        self._spec = spec
        self._engine_metrics = engine_metrics
        self._worker_id = worker_id
        self._targets = targets
        # Requests posted to the engine thread that its latest stats may not include yet, by
        # ticket: (lane, tokens to compute); forgotten once the stats include them.
        self._posted: dict[int, tuple[Lane, int]] = {}
        self._token_stream_max_age_s = token_stream_max_age_s
        self._thread: EngineThread | EngineProcess | None = None  # from start()
        self._kv_events: KvEventPublisher | None = None  # from start()
        self._js: JetStreamContext | None = None  # once the token stream is there
        self._replies = HeldReplies()
        self._failure: str | None = None
        self._failed = asyncio.Event()
        self._cancels = RecentCancels()  # a cancel may overtake the reply's assignment
        self._handoffs: dict[str, asyncio.Future[RequestOutput]] = {}
        self._outbox: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, bus: Bus) -> None:
        """Starts loading the engine (is_ready tells when it is loaded) and publishing on `bus`."""
        loop = asyncio.get_running_loop()
        self._kv_events = KvEventPublisher(self._worker_id, loop)
        kv_events = self._kv_events
        if self._spec.engine_process:
            process = EngineProcess(self._spec, self._outbox.put_nowait, loop, self._on_change, self._on_engine_death, self._spec.log_level)
            self._thread = process
            state = partial(_kv_state, process, kv_events)
        else:
            thread = EngineThread(self._build_engine, self._outbox.put_nowait, loop, self._after_change, self._on_engine_death)
            self._thread = thread
            state = partial(thread.call, kv_events.snapshot)
        self._thread.start()
        publishing = asyncio.create_task(self._publish_outputs(bus), name="publish-tokens")
        publishing.add_done_callback(self._on_publisher_done)
        self._tasks = [
            publishing,
            asyncio.create_task(self._publish_kv_events(bus, kv_events, state), name="publish-kv-events"),
        ]

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until every reply this worker holds has ended (True), or `timeout_s` (False)."""
        return await self._replies.wait_none_held(timeout_s)

    async def stop(self) -> None:
        """Gives up the replies still held (no more claims, no more events), then stops the engine."""
        self._replies.release_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.stop)
        for task in self._tasks:
            task.cancel()

    def _build_engine(self) -> Engine:
        """On the engine thread, which runs every step."""
        return build_engine(self._spec)

    def _on_change(self, stats: EngineStats, events: list[KvEvent], waits: list[QueueWait]) -> None:
        """For each change: on the loop as the engine process reports it, or on the engine thread
        (`_after_change`); numbering KV events and observing metrics are safe from either."""
        if self._kv_events is not None:
            self._kv_events.collect_events(events)
        if self._engine_metrics is not None:
            self._engine_metrics.observe(stats, waits)

    def _after_change(self, engine: Engine) -> None:
        """On the engine thread after every change (the thread took fresh stats just before): what
        the engine recorded goes where an engine process's report goes (`_on_change`)."""
        stats = self._thread.latest_stats if self._thread is not None else None
        if stats is not None:
            self._on_change(stats, engine.drain_kv_events(), engine.drain_queue_waits())

    @property
    def _engine_thread(self) -> EngineThread | EngineProcess:
        if self._thread is None:
            raise RuntimeError("the engine host is not started")
        return self._thread

    async def is_ready(self) -> bool:
        """The engine is loaded and alive, token events can be published, and nothing failed."""
        return self._failure is None and self._js is not None and self._thread is not None and self._thread.is_ready

    # -- failure --------------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why this host cannot go on, or None while it can."""
        return self._failure

    async def wait_failed(self) -> str:
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    def _fail(self, reason: str) -> None:
        if self._failure is not None:
            return
        log.error("this worker cannot go on: %s; it gives up its replies (another worker continues them)", reason)
        self._failure = reason
        self._replies.release_all()
        for prefilled in self._handoffs.values():  # no output will come for them
            if not prefilled.done():
                prefilled.set_exception(WorkerFailed(reason))
        self._handoffs.clear()
        self._failed.set()

    def _on_engine_death(self, exc: BaseException) -> None:
        self._fail(f"the engine died: {type(exc).__name__}: {exc}")

    def _on_publisher_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self._fail(f"the token publisher stopped: {type(exc).__name__}: {exc}" if exc else "the token publisher stopped")

    def load(self) -> EngineLoad | None:
        """The engine's load for the heartbeat; None until the engine is loaded, and once failed."""
        thread = self._thread
        state = self.queue_state()
        if thread is None or state is None or thread.latest_stats is None:
            return None
        stats = thread.latest_stats
        mean_step_ms = 1000 * (stats.prefill_time_s + stats.decode_time_s) / max(1, stats.num_steps)
        waits = {lane: state.estimated_wait_s(lane) or 0.0 for lane in Lane}
        for lane, wait_s in waits.items():
            metrics.ESTIMATED_WAIT.labels(lane=lane.name.lower()).set(wait_s)
        metrics.PREFILL_RATE.set(state.prefill_tokens_per_s)
        return EngineLoad(
            stats,
            thread.facts.kv_shape.num_blocks,
            thread.facts.max_position_embeddings,
            mean_step_ms,
            last_kv_event_id=self._kv_events.last_published_event_id if self._kv_events else 0,
            prefill_tokens_per_s=state.prefill_tokens_per_s,
            estimated_wait_s=waits[Lane.FREE],
            free_ttft_target_s=self._targets.free_s,
        )

    # -- admission by expected wait -------------------------------------------------------------

    def queue_state(self) -> QueueState | None:
        """What goes before a request offered now: the engine's latest stats plus the requests
        posted since; None until the engine is loaded, and once failed."""
        thread = self._thread
        snapshot = thread.snapshot if thread is not None else None
        if self._failure is not None or thread is None or not thread.is_ready or snapshot is None:
            return None
        stats, num_applied = snapshot
        for ticket in [t for t in self._posted if t <= num_applied]:
            del self._posted[ticket]
        s = stats.scheduler
        waiting = dict(s.num_waiting_prefill_tokens)
        waiting_seqs = dict(s.num_waiting)
        for lane, num_tokens in self._posted.values():
            waiting[lane] += num_tokens
            waiting_seqs[lane] += 1
        return QueueState(
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            waiting_prefill_tokens=waiting,
            running_prefill_tokens=s.num_running_prefill_tokens,
            num_free_blocks=max(0, s.num_free_blocks - self._spec.engine.num_reserved_blocks),
            running_blocks=s.num_running_blocks,
            block_size=self._spec.engine.block_size,
            has_idle_capacity=s.has_idle_capacity and not any(lane < Lane.BACKGROUND for lane, _ in self._posted.values()),
            waiting_seqs=waiting_seqs,
            admissions_per_s=stats.admissions_per_s,
        )

    def overloaded(self, request: Request) -> Overloaded | None:
        """Why this worker would not start `request` in time if it took it now, or None (also
        while the engine is not loaded: the caller refuses that as loading)."""
        state = self.queue_state()
        if state is None:
            return None
        return queue_verdict(state, request.lane, _num_tokens(request), self._targets)

    # -- what the loop may ask at once (the engine's configuration, blocks no step touches) -----

    async def check(self, request: Request) -> None:
        """Raises PromptTooLong, EmptyPrompt or TokenIdOutOfRange for a request this engine could
        never run; answers without waiting for the step in progress."""
        await self._engine_thread.check(request)

    def kv_layout(self) -> KvLayout:
        """The shape and dtype of this engine's KV blocks, which a handoff's two sides must share."""
        return kv_layout(self._engine_thread.facts, self._spec.model.name)

    def block_views(self, block_ids: Iterable[int]) -> list[torch.Tensor]:
        """Each block's K and V for every layer, to send from or receive into; only for blocks this
        worker holds for a handoff (exported or reserved), which no step reads or writes."""
        engine = self._engine_thread
        return [engine.block_view(block_id) for block_id in block_ids]

    # -- replies --------------------------------------------------------------------------------

    def add(self, request: Request, first_seq: int, epoch: int) -> None:
        """Queues `request` and publishes its tokens from sequence number `first_seq` on, stamped
        with the owner `epoch`."""
        self._replies.stream(request.request_id, first_seq, epoch)
        self._post_add(request)

    async def prefill_only(self, request: Request, first_seq: int, epoch: int) -> RequestOutput:
        """Prefills `request` here and publishes its first token as `first_seq`; returns the output
        that carries its handoff (None when the reply ended at its first token). Its blocks stay
        held until `release` or `discard`."""
        self._replies.stream(request.request_id, first_seq, epoch)
        prefilled = asyncio.get_running_loop().create_future()
        self._handoffs[request.request_id] = prefilled
        self._post_add(request, prefill_only=True)
        return await prefilled

    def _post_add(self, request: Request, prefill_only: bool = False) -> None:
        ticket = self._engine_thread.post(partial(_add, request, prefill_only=prefill_only))
        self._posted[ticket] = (request.lane, _num_tokens(request))
        if request.lane is Lane.PAID:  # a step of free work in progress ends now, and the next is this request's
            self._engine_thread.cut_step()

    def is_streaming(self, reply_id: str) -> bool:
        """This host publishes the reply's tokens (it runs here, or is about to)."""
        return self._replies.is_streaming(reply_id)

    def streaming_epoch(self, reply_id: str) -> int | None:
        """The owner epoch of the reply's stream here, or None when it does not stream here."""
        stream = self._replies.stream_of(reply_id)
        return None if stream is None else stream.epoch

    def stop_streaming(self, reply_id: str) -> int | None:
        """Publishes nothing more of the reply (the caller ends its stream); returns the seq its
        next event would have taken (None when it never streamed here), for the caller's final event."""
        self._replies.end_stream(reply_id)
        return self._replies.next_seq(reply_id)

    def hold(self, reply_id: str) -> None:
        """Claims a reply this worker works on outside the engine's stream (a handoff in flight)."""
        self._replies.hold(reply_id)

    def let_go(self, reply_id: str) -> None:
        self._replies.let_go(reply_id)

    def claimed_reply_ids(self) -> list[str]:
        """Every reply this worker will finish, for its heartbeat; none once it failed or stopped."""
        return self._replies.claimed()

    def abort(self, reply_id: str) -> None:
        """Cancels a running reply; its last output says so."""
        self._engine_thread.post(partial(_abort, reply_id))

    def discard(self, reply_id: str) -> None:
        """Drops a reply wherever it is: aborted while it runs, released once prefilled."""
        self._engine_thread.post(partial(_discard, reply_id))

    def release(self, reply_id: str) -> None:
        """Frees a prefilled reply's blocks once its handoff is over (their content stays cached)."""
        self._engine_thread.post(partial(_release, reply_id))

    # -- imports (the decode side of a handoff) -------------------------------------------------

    async def reserve_import(self, request: Request, num_blocks: int) -> ImportReservation:
        """Holds `num_blocks` blocks for `request`'s KV: its cached prefix, then fresh blocks for the
        rest; raises NoFreeBlocks when they do not fit."""
        return await self._engine_thread.call(partial(_reserve_import, request, num_blocks))

    def cancel_import(self, reservation: ImportReservation) -> None:
        self._engine_thread.post(partial(_cancel_import, reservation))

    async def import_sequence(
        self,
        request: Request,
        reservation: ImportReservation,
        first_token_id: int,
        num_cached_tokens: int,
        first_seq: int,
        epoch: int,
    ) -> None:
        """Continues a reply prefilled elsewhere from the reservation's blocks, publishing its tokens
        from `first_seq` on with the owner `epoch`; raises ValueError when the engine cannot take
        it (the reservation stays the caller's to cancel)."""
        self._replies.stream(request.request_id, first_seq, epoch)
        try:
            await self._engine_thread.call(partial(_import_sequence, request, reservation, first_token_id, num_cached_tokens))
        except (ValueError, EngineDead):
            self.stop_streaming(request.request_id)
            raise

    # -- cancels --------------------------------------------------------------------------------

    def note_cancel(self, reply_id: str) -> None:
        self._cancels.note(reply_id)

    def is_cancelled(self, reply_id: str) -> bool:
        """Cancelled lately: a reply not started yet must not start."""
        return reply_id in self._cancels

    async def subscribe_cancels(self, client: Client) -> None:
        """Cancels from the bus: noted, and the reply aborted when it runs here."""
        await client.subscribe(subjects.CANCEL_ALL, cb=self._on_cancel)

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            reply_id = validate.cancel(msg.data, msg.subject).reply_id
        except validate.Invalid as exc:  # garbage, or a payload naming another reply than its subject
            validate.drop("cancel", msg.subject, exc)
            return
        self.note_cancel(reply_id)
        if self.is_streaming(reply_id) and self._thread is not None:
            self.abort(reply_id)

    # -- publishing -----------------------------------------------------------------------------

    async def _publish_kv_events(self, bus: Bus, kv_events: KvEventPublisher, state: Callable[[], Awaitable[KvState]]) -> None:
        client = await bus.wait_connected()
        await kv_events.run(client, lambda: self._thread is not None and self._thread.is_ready, state)

    async def publish(self, event: TokenEvent) -> bool:
        """Publishes an event the worker makes itself (a cancelled reply's final event); False, and
        the host failed, when it cannot."""
        if self._js is None or self._failure is not None:
            return False
        try:
            await publish_event(self._js, event)
        except CannotPublish as exc:
            self._fail(f"cannot publish token events: {exc}")
            return False
        return True

    async def _publish_outputs(self, bus: Bus) -> None:
        """Each step's events go out together, replies side by side but each reply's in order (and
        the next step's after them); a reply stops being held once its final event (or its
        handoff's first token) is stored."""
        client = await bus.wait_connected()
        js = self._js = await open_token_stream(client, self._token_stream_max_age_s)
        while True:
            outputs = await self._outbox.get()
            by_reply: dict[str, list[TokenEvent]] = {}
            ended: list[tuple[str, ReplyStream]] = []
            for output in outputs:
                stream = self._replies.stream_of(output.request_id)
                if stream is None:
                    continue
                event = token_event(output, stream.next_seq, self._worker_id, stream.epoch, self._spec.model.name)
                by_reply.setdefault(output.request_id, []).append(event)
                stream.next_seq += 1
                if output.is_finished or output.handoff is not None:
                    ended.append((output.request_id, stream))
            bus_is_up = server_answers(client)
            await asyncio.gather(*(_publish_in_order(js, events, bus_is_up) for events in by_reply.values()))
            for reply_id, stream in ended:
                self._replies.end_stream(reply_id, stream)
            for output in outputs:
                handoff = self._handoffs.pop(output.request_id, None) if output.is_finished or output.handoff is not None else None
                if handoff is not None and not handoff.done():
                    handoff.set_result(output)


async def _publish_in_order(js: JetStreamContext, events: list[TokenEvent], bus_is_up: BusProbe) -> None:
    for event in events:
        await publish_event(js, event, bus_is_up=bus_is_up)


def _num_tokens(request: Request) -> int:
    """The tokens a request's prefill computes (a continuation's generated ones too)."""
    return len(request.prompt_token_ids) + len(request.generated_token_ids)


# What the host asks of its engine, as module-level functions (functools.partial of them): an
# engine process receives them pickled, which a closure cannot be.


def _add(request: Request, engine: Engine, prefill_only: bool = False) -> None:
    engine.add(request, prefill_only=prefill_only)


def _abort(reply_id: str, engine: Engine) -> None:
    engine.abort(reply_id)


def _discard(reply_id: str, engine: Engine) -> None:
    engine.discard(reply_id)


def _release(reply_id: str, engine: Engine) -> None:
    engine.release(reply_id)


def _reserve_import(request: Request, num_blocks: int, engine: Engine) -> ImportReservation:
    return engine.reserve_import(request, num_blocks)


def _cancel_import(reservation: ImportReservation, engine: Engine) -> None:
    engine.cancel_import(reservation)


def _import_sequence(request: Request, reservation: ImportReservation, first_token_id: int, num_cached_tokens: int, engine: Engine) -> None:
    engine.import_sequence(request, reservation, first_token_id, num_cached_tokens)


def _cached_blocks(engine: Engine) -> list[CachedBlock]:
    return engine.cached_blocks()


async def _kv_state(process: EngineProcess, kv_events: KvEventPublisher) -> KvState:
    """The engine process's cached blocks, numbered as of the last KV event: the process sends
    what it recorded before a call's result, and the loop numbers it as it arrives."""
    return kv_events.state_of(await process.call(_cached_blocks))
