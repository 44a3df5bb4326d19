"""A worker's engine behind a named async API. The engine steps in a process of its own on a CPU
(engine_process.py: it never waits for the loop's GIL) or on a thread of its own (thread.py, on a
GPU or with TANDEM_ENGINE_PROCESS=false), so the loop stays free for NATS, gRPC and UCX; the host is
the only door to it, and its callers never see which. The host also publishes each reply's outputs
as TokenEvents on JetStream (output_publisher.py), its prefix cache's changes as KV events (and its
full state on request), applies cancels, keeps the replies this worker holds (its heartbeat claims
them), reports the engine's load and judges whether a request offered now would start within its
lane's TTFT target (admission.py, posted_work.py). Decode and prefill workers both build one.

A host that cannot go on (its engine died, its token events cannot be published) is failed:
`failure` says why, it is not ready, it claims no reply, and `wait_failed` wakes the worker, which
exits so that its supervisor restarts it.

Changes that nobody needs to wait for (an add, an abort, a release) are queued and return at once:
the engine takes them between two steps, and a step can take seconds on a CPU."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from functools import partial

import torch
from nats.aio.client import Client
from nats.aio.msg import Msg

from tandem.bus import Bus, subjects, validate
from tandem.bus.cancels import RecentCancels
from tandem.engine.block_pool import KvEvent
from tandem.engine.engine import Engine, EngineStats, ImportReservation, QueueWait, Request, RequestOutput
from tandem.engine.sequence import Lane
from tandem.v1.kv_handoff_pb2 import KvLayout
from tandem.v1.kv_pb2 import KvState
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.worker import engine_calls, metrics
from tandem.worker.admission import Overloaded, QueueState, TtftTargets, queue_verdict
from tandem.worker.engine_metrics import EngineMetrics
from tandem.worker.engine_process import EngineProcess
from tandem.worker.engine_ranks import PeerRanks
from tandem.worker.engine_spec import EngineSpec, build_engine
from tandem.worker.heartbeat import EngineLoad
from tandem.worker.kv_events import KvEventPublisher
from tandem.worker.output_publisher import OutputPublisher
from tandem.worker.posted_work import PostedWork, num_prefill_tokens
from tandem.worker.replies import HeldReplies
from tandem.worker.thread import EngineDead, EngineThread
from tandem.worker.token_publisher import CannotPublish
from tandem.worker.wire import kv_layout

log = logging.getLogger(__name__)


class WorkerFailed(Exception):
    """This worker failed (see EngineHost.failure) while the caller waited on its engine."""


class EngineHost:
    def __init__(
        self,
        spec: EngineSpec,
        worker_id: str,
        targets: TtftTargets,
        engine_metrics: EngineMetrics | None = None,
    ) -> None:
        self._spec = spec
        self._engine_metrics = engine_metrics
        self._worker_id = worker_id
        self._targets = targets
        self._posted = PostedWork()
        self._driver: EngineThread | EngineProcess | None = None  # from start()
        self._peers: PeerRanks | None = None  # the other ranks of a tensor-parallel engine on a thread
        self._kv_events: KvEventPublisher | None = None  # from start()
        self._replies = HeldReplies()
        self._outputs = OutputPublisher(self._replies, worker_id, spec.model.name)
        self._failure: str | None = None
        self._failed = asyncio.Event()
        self._cancels = RecentCancels()  # a cancel may overtake the reply's assignment
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, bus: Bus) -> None:
        """Starts loading the engine (is_ready tells when it is loaded) and publishing on `bus`."""
        loop = asyncio.get_running_loop()
        self._kv_events = KvEventPublisher(self._worker_id, loop)
        kv_events = self._kv_events
        if self._spec.engine_process:
            process = EngineProcess(self._spec, self._outputs.put, loop, self._on_change, self._on_engine_death, self._spec.log_level)
            self._driver = process
            state = partial(_kv_state, process, kv_events)
        else:
            if self._spec.tensor_parallel_size > 1:  # rank 0 on the engine thread, the others beside it
                self._peers = PeerRanks.start(self._spec)
                self._spec = self._peers.spec
                self._peers.watch(partial(_call_on_loop, loop, self._on_rank_death))
            thread = EngineThread(self._build_engine, self._outputs.put, loop, self._after_change, self._on_engine_death)
            self._driver = thread
            state = partial(thread.call, kv_events.snapshot)
        self._driver.start()
        publishing = asyncio.create_task(self._outputs.run(bus), name="publish-tokens")
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
        if self._peers is not None:
            self._peers.ending()  # the engine thread's rank 0 stops them as it ends: not a death
        if self._driver is not None:
            await asyncio.to_thread(self._driver.stop)
        if self._peers is not None:
            await asyncio.to_thread(self._peers.stop)
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
        stats = self._driver.latest_stats if self._driver is not None else None
        if stats is not None:
            self._on_change(stats, engine.drain_kv_events(), engine.drain_queue_waits())

    @property
    def _engine_driver(self) -> EngineThread | EngineProcess:
        if self._driver is None:
            raise RuntimeError("the engine host is not started")
        return self._driver

    async def is_ready(self) -> bool:
        """The engine is loaded and alive, token events can be published, and nothing failed."""
        return self._failure is None and self._outputs.is_open and self._is_engine_ready()

    def _is_engine_ready(self) -> bool:
        return self._driver is not None and self._driver.is_ready

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
        self._outputs.fail_handoffs(WorkerFailed(reason))
        self._failed.set()

    def _on_engine_death(self, exc: BaseException) -> None:
        self._fail(f"the engine died: {type(exc).__name__}: {exc}")

    def _on_rank_death(self, rank: int, code: int) -> None:
        self._fail(f"rank {rank} of the tensor-parallel engine ended (exit code {code})")

    def _on_publisher_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self._fail(f"the token publisher stopped: {type(exc).__name__}: {exc}" if exc else "the token publisher stopped")

    def load(self) -> EngineLoad | None:
        """The engine's load for the heartbeat; None until the engine is loaded, and once failed."""
        driver = self._driver
        state = self.queue_state()
        if driver is None or state is None or driver.latest_stats is None:
            return None
        stats = driver.latest_stats
        mean_step_ms = 1000 * (stats.prefill_time_s + stats.decode_time_s) / max(1, stats.num_steps)
        waits = {lane: state.estimated_wait_s(lane) or 0.0 for lane in Lane}
        for lane, wait_s in waits.items():
            metrics.ESTIMATED_WAIT.labels(lane=lane.name.lower()).set(wait_s)
        metrics.PREFILL_RATE.set(state.prefill_tokens_per_s)
        return EngineLoad(
            stats,
            driver.facts.kv_shape.num_blocks,
            driver.facts.max_position_embeddings,
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
        driver = self._driver
        snapshot = driver.snapshot if driver is not None else None
        if self._failure is not None or driver is None or not driver.is_ready or snapshot is None:
            return None
        stats, num_applied = snapshot
        return self._posted.queue_state(stats, num_applied, self._spec.engine)

    def overloaded(self, request: Request) -> Overloaded | None:
        """Why this worker would not start `request` in time if it took it now, or None (also
        while the engine is not loaded: the caller refuses that as loading)."""
        state = self.queue_state()
        if state is None:
            return None
        return queue_verdict(state, request.lane, num_prefill_tokens(request), self._targets)

    # -- what the loop may ask at once (the engine's configuration, blocks no step touches) -----

    async def check(self, request: Request) -> None:
        """Raises PromptTooLong, EmptyPrompt or TokenIdOutOfRange for a request this engine could
        never run; answers without waiting for the step in progress."""
        await self._engine_driver.check(request)

    def kv_layout(self) -> KvLayout:
        """The shape and dtype of this engine's KV blocks, which a handoff's two sides must share."""
        return kv_layout(self._engine_driver.facts, self._spec.model.name)

    def block_views(self, block_ids: Iterable[int]) -> list[torch.Tensor]:
        """Each block's K and V for every layer, to send from or receive into; only for blocks this
        worker holds for a handoff (exported or reserved), which no step reads or writes."""
        engine = self._engine_driver
        return [view for block_id in block_ids for view in engine.block_views(block_id)]

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
        prefilled = self._outputs.expect_handoff(request.request_id)
        self._post_add(request, prefill_only=True)
        return await prefilled

    def _post_add(self, request: Request, prefill_only: bool = False) -> None:
        ticket = self._engine_driver.post(partial(engine_calls.add, request, prefill_only=prefill_only))
        self._posted.note(ticket, request)
        if request.lane is Lane.PAID:  # a step of free work in progress ends now, and the next is this request's
            self._engine_driver.cut_step()

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
        self._engine_driver.post(partial(engine_calls.abort, reply_id))

    def discard(self, reply_id: str) -> None:
        """Drops a reply wherever it is: aborted while it runs, released once prefilled."""
        self._engine_driver.post(partial(engine_calls.discard, reply_id))

    def release(self, reply_id: str) -> None:
        """Frees a prefilled reply's blocks once its handoff is over (their content stays cached)."""
        self._engine_driver.post(partial(engine_calls.release, reply_id))

    # -- imports (the decode side of a handoff) -------------------------------------------------

    async def reserve_import(self, request: Request, num_blocks: int) -> ImportReservation:
        """Holds `num_blocks` blocks for `request`'s KV: its cached prefix, then fresh blocks for the
        rest; raises NoFreeBlocks when they do not fit."""
        return await self._engine_driver.call(partial(engine_calls.reserve_import, request, num_blocks))

    def cancel_import(self, reservation: ImportReservation) -> None:
        self._engine_driver.post(partial(engine_calls.cancel_import, reservation))

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
            await self._engine_driver.call(partial(engine_calls.import_sequence, request, reservation, first_token_id, num_cached_tokens))
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
        if self.is_streaming(reply_id) and self._driver is not None:
            self.abort(reply_id)

    # -- publishing -----------------------------------------------------------------------------

    async def _publish_kv_events(self, bus: Bus, kv_events: KvEventPublisher, state: Callable[[], Awaitable[KvState]]) -> None:
        client = await bus.wait_connected()
        await kv_events.run(client, self._is_engine_ready, state)

    async def publish(self, event: TokenEvent) -> bool:
        """Publishes an event the worker makes itself (a cancelled reply's final event); False, and
        the host failed, when it cannot."""
        if not self._outputs.is_open or self._failure is not None:
            return False
        try:
            await self._outputs.publish(event)
        except CannotPublish as exc:
            self._fail(f"cannot publish token events: {exc}")
            return False
        return True


async def _kv_state(process: EngineProcess, kv_events: KvEventPublisher) -> KvState:
    """The engine process's cached blocks, numbered as of the last KV event: the process sends
    what it recorded before a call's result, and the loop numbers it as it arrives."""
    return kv_events.state_of(await process.call(engine_calls.cached_blocks))


def _call_on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[int, int], None], rank: int, code: int) -> None:
    """A rank's watcher thread hands its death to the loop."""
    loop.call_soon_threadsafe(callback, rank, code)
