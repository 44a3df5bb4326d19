"""`tandem.v1.generate`: admit or refuse, answer with the reply id, and hand the reply over in the
background: to a prefill worker naming the chosen decode worker when the uncached prompt is long
(disaggregated), else to the decode worker itself (local prefill). If no prefill worker takes it,
the decode workers are offered it with local prefill. A handoff that fails comes back
(HandoffOutcome) and the reply is placed again without that decode worker.

A new reply placed on decode workers is answered once one of them took it, or once every one
refused it (then the answer is the refusal: the caller says 503 at the door, with the soonest
worker's retry time), waiting at most `answer_wait_s`; after that it is answered as accepted, and
a placement that fails later ends the reply with an error event, as every failed handoff does.

Every assignment of a reply carries the request's owner epoch (0 for a new reply, one more for each
continuation the relay makes), and so does any final event the router ends a reply with; those go
on the token stream (JetStream), like the workers' events."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg

from services.router import metrics
from services.router.admission import Admitted, admit, large_model, parse_request
from services.router.dispatch import QUEUE_FULL, Assign, DispatchConfig, DispatchResult, dispatch, failure_event
from services.router.handoffs import HandoffOutcomes, continuation
from services.router.ladder import Ladder
from services.router.lanes import LANE_NAMES, LaneRefusals, WaitTargets, door_refusal, lane_of, order_for_lane
from services.router.overload import Overload
from services.router.placement import Placement, affinity_key, can_serve, num_context_tokens
from services.router.pools import DOWN, FULL, ModelPools, count_fallback
from services.router.rollout_state import Rollouts
from services.router.versions import VersionPicker, count_version
from services.router.workers import LiveWorker, WorkerRegistry
from tandem.bus import encode, validate
from tandem.bus.cancels import RecentCancels
from tandem.bus.events import cancelled_event, error_event
from tandem.v1.dispatch_pb2 import Assignment, HandoffOutcome
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest, Refusal
from tandem.v1.tokens_pb2 import TokenEvent

DECODE_ROLE = "decode"
PREFILL_ROLE = "prefill"
log = logging.getLogger(__name__)

# Puts one TokenEvent on the token stream (tandem.bus.token_stream.publish_token in production).
PublishEvent = Callable[[TokenEvent], Awaitable[None]]
PUBLISH_ATTEMPTS = 3  # a final event lost here leaves the reply to the relay's stall detection


def new_reply_id() -> str:
    """32 hex digits: unique, and a valid NATS subject token."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Job:
    """An admitted reply and the workers to offer it to, best first."""

    assignment: Assignment
    worker_ids: tuple[str, ...]
    admitted_at_s: float
    # Offered first when the prompt is long: prefill workers, with an assignment naming the decode worker.
    remote: tuple[Assignment, tuple[str, ...]] | None = None
    model: str = ""  # the admitted model, for placing the reply again


@dataclass(frozen=True)
class _HandoffFailed:
    """A remote placement that came back: the decode worker to avoid, and the reply to place next
    (a continuation when the prefill worker had published tokens already)."""

    decode_worker_id: str
    assignment: Assignment
    detail: str


_HANDED_OVER = "handed_over"  # the prefill worker's handoff committed, or the reply ended there
_PREFILL_LOCALLY = "prefill_locally"  # no prefill worker took it, for reasons of their own


class GenerateService:
    def __init__(
        self,
        workers: WorkerRegistry,
        placement: Placement,
        assign: Assign,
        publish_event: PublishEvent,
        config: DispatchConfig = DispatchConfig(),
        overload: Overload | None = None,
        targets: WaitTargets = WaitTargets(),
        refusals: LaneRefusals | None = None,
        pools: ModelPools = ModelPools(),
        versions: VersionPicker | None = None,
    ) -> None:
        self._workers = workers
        self._pools = pools
        self._versions = versions or VersionPicker(Rollouts())  # no rollout: each name's most served version
        self._overload = overload or Overload(Ladder(interval_s=10.0))  # rung 0 unless a ladder moves it
        self._targets = targets
        self.refusals = refusals or LaneRefusals()  # registry's on_forget should reach its forget
        self._placement = placement
        self._assign = assign
        self._publish_event_once = publish_event
        self._config = config
        self._dispatching: set[asyncio.Task[None]] = set()
        self._cancels = RecentCancels()
        self.outcomes = HandoffOutcomes()  # subscribe its on_message to subjects.HANDOFFS_ALL

    async def on_cancel(self, msg: Msg) -> None:
        """A cancel may come before the reply reaches any worker: remember it."""
        try:
            cancelled = validate.cancel(msg.data, msg.subject)
        except validate.Invalid as exc:
            validate.drop("cancel", msg.subject, exc)
            return
        self._cancels.note(cancelled.reply_id)

    async def on_request(self, msg: Msg) -> None:
        """The NATS callback: never raises, whatever the payload."""
        if not msg.reply:
            log.warning("dropped a generate message without a reply subject (send it as a request)")
            return
        reply, job = self.handle(msg.data)
        answer = self._placement_answer(job) if job is not None else None
        if job is not None:
            self._spawn(self.dispatch(job, answer), f"dispatch:{job.assignment.reply_id}")
        if answer is None:
            await msg.respond(encode(reply))
        else:  # in a task: NATS hands this subscription its messages one at a time
            self._spawn(self._answer_placed(msg, reply, answer), f"answer:{reply.reply_id}")

    def _spawn(self, work: Coroutine[object, object, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._dispatching.add(task)
        task.add_done_callback(self._dispatching.discard)

    async def _answer_placed(self, msg: Msg, accepted: GenerateReply, answer: asyncio.Future[Refusal | None]) -> None:
        refusal = await self._await_placement(answer)
        try:
            await msg.respond(encode(self._refuse(refusal) if refusal is not None else accepted))
        except nats.errors.Error as exc:  # the caller times out and cancels what it asked for
            log.warning("could not answer the generate request of reply %s: %s", accepted.reply_id, exc)

    def _placement_answer(self, job: Job) -> asyncio.Future[Refusal | None] | None:
        """What the caller's answer waits for: a new reply placed on decode workers gets a future
        the placement settles (None: a worker took it); a remote prefill or a continuation, none."""
        if job.remote is not None or job.assignment.request.resume_reply_id:
            return None
        return asyncio.get_running_loop().create_future()

    async def _await_placement(self, answer: asyncio.Future[Refusal | None]) -> Refusal | None:
        """The placement's refusal, if it came within answer_wait_s; past that the reply is taken as
        accepted (the future settled None), so a later failure ends it with an error event."""
        try:
            return await asyncio.wait_for(asyncio.shield(answer), self._config.answer_wait_s)
        except TimeoutError:
            if not answer.done():
                answer.set_result(None)
            return None

    def handle(self, data: bytes) -> tuple[GenerateReply, Job | None]:
        """The answer to one generate payload, and the dispatch job when it was admitted."""
        request = parse_request(data)
        if isinstance(request, Refusal):
            return self._refuse(request), None
        workers = self._workers.workers(DECODE_ROLE)
        choice = self._versions.pick_for(request, large_model(workers, self._pools), workers)
        request.model = choice.model
        admitted = self._admit(request, workers)
        if not isinstance(admitted, Refusal) and not request.resume_reply_id:  # a continuation was admitted once: not refused again
            admitted = self._admit_at_rung(request, admitted)
        if isinstance(admitted, Refusal):
            return self._refuse(admitted), None
        # A continuation keeps its reply id and numbering: the logged tokens come first. Its epoch
        # (the relay's count of owners) goes with every assignment of it, re-placements included.
        reply_id = request.resume_reply_id or request.reply_id or new_reply_id()
        assignment = Assignment(reply_id=reply_id, request=request, first_seq=len(request.generated_token_ids) + 1, epoch=request.epoch)
        metrics.REQUESTS_ACCEPTED.labels(model=admitted.model).inc()
        count_version(admitted.model, request)
        job = self._plan(assignment, admitted.model, frozenset(), time.monotonic())
        return GenerateReply(reply_id=reply_id, model=admitted.model, shadow_model=choice.shadow_for(admitted.model)), job

    def _admit(self, request: GenerateRequest, workers: list[LiveWorker]) -> Admitted | Refusal:
        """admit(), and when no worker of the asked model takes work now, the other pool's model
        where services.router.pools allows it (the request names it from then on)."""
        admitted = admit(request, workers, self._pools)
        if not isinstance(admitted, Refusal) or admitted.reason != "no_workers":
            return admitted
        other = self._pools.when_down(request.model, lane_of(request), workers)
        moved = self._readmit(request, self._versions.version_of(other, request, workers), workers) if other else None
        if moved is None:
            return admitted
        count_fallback(request.model, moved.model, DOWN)
        request.model = moved.model
        return moved

    def _admit_at_rung(self, request: GenerateRequest, admitted: Admitted) -> Admitted | Refusal:
        """The overload ladder's verdict (it may cap the request in place, or name the small
        model), then the door: refused when no worker of the model can start it within its lane's
        target (by their refusals, and for free work their heartbeats' expected waits), unless
        it is the small model's and the large pool can (services.router.pools)."""
        lane = lane_of(request)
        workers = self._workers.workers(DECODE_ROLE)
        verdict = self._overload.apply(request, lane, admitted.model, large_model(workers, self._pools), workers, self._pools.small)
        if isinstance(verdict, Refusal):
            return verdict
        if verdict.model != admitted.model:
            small = self._versions.version_of(verdict.model, request, workers)
            readmitted = self._readmit(request, small, workers)  # the small model's window must hold it too
            if readmitted is not None:
                request.model, admitted = small, readmitted
        refused = self._door(lane, admitted.model, workers)
        if refused is None:
            return admitted
        other = self._pools.when_full(admitted.model)
        moved = self._readmit(request, self._versions.version_of(other, request, workers), workers) if other else None
        if moved is None or self._door(lane, moved.model, workers) is not None:
            return refused
        count_fallback(admitted.model, moved.model, FULL)
        request.model = moved.model
        return moved

    def _door(self, lane: int, model: str, workers: list[LiveWorker]) -> Refusal | None:
        serving = [w for w in workers if can_serve(w, model)]
        return door_refusal(lane, model, serving, self.refusals, self._targets)

    def _readmit(self, request: GenerateRequest, model: str, workers: list[LiveWorker]) -> Admitted | None:
        """The request admitted for `model` instead (its window must hold it too), or None."""
        moved = GenerateRequest()
        moved.CopyFrom(request)
        moved.model = model
        admitted = admit(moved, workers, self._pools)
        return admitted if isinstance(admitted, Admitted) else None

    def _plan(self, assignment: Assignment, model: str, excluded: frozenset[str], admitted_at_s: float) -> Job:
        """Where the reply goes: decode workers best first (none of `excluded`), and prefill
        workers first when its uncached part is long."""
        request = assignment.request
        decode_workers = [w for w in self._workers.workers(DECODE_ROLE) if w.instance_id not in excluded]
        ranked = self._placement.rank(decode_workers, model, request, affinity_key(request, assignment.reply_id))
        ranked = order_for_lane(ranked, lane_of(request), self._targets, self.refusals)
        remote = self._remote(assignment, ranked, model)
        if ranked:
            # Counted from the moment it is chosen, so a burst spreads before any worker answers: as
            # the prefill it will do itself (none when a prefill worker reads the prompt, only the
            # uncached part otherwise), so a cached follow-up turn does not weigh as a whole prompt.
            num_own_prefill = 0 if remote is not None else self._placement.num_uncached_tokens(ranked[0], request)
            self._workers.note_assigned(ranked[0].instance_id, num_own_prefill)
            metrics.PLACEMENTS.labels(role=DECODE_ROLE, reason=self._placement.reason(ranked, request)).inc()
        worker_ids = tuple(w.instance_id for w in ranked)
        return Job(assignment, worker_ids, admitted_at_s, remote, model)

    def _remote(self, assignment: Assignment, ranked_decode: list[LiveWorker], model: str) -> tuple[Assignment, tuple[str, ...]] | None:
        if not ranked_decode or not self._placement.should_prefill_remotely(ranked_decode[0], assignment.request):
            return None
        key = affinity_key(assignment.request, assignment.reply_id)
        prefill = self._placement.rank(self._workers.workers(PREFILL_ROLE), model, assignment.request, key)
        if not prefill:
            return None
        # Counted at once like a decode worker's, so a burst spreads over the prefill workers too.
        self._workers.note_assigned(prefill[0].instance_id, self._placement.num_uncached_tokens(prefill[0], assignment.request))
        metrics.PLACEMENTS.labels(role=PREFILL_ROLE, reason=self._placement.reason(prefill, assignment.request)).inc()
        decode_worker = ranked_decode[0].heartbeat
        remote = Assignment()
        remote.CopyFrom(assignment)
        remote.decode_worker_id = decode_worker.service.instance_id
        remote.decode_grpc_address = decode_worker.grpc_address
        return remote, tuple(w.instance_id for w in prefill)

    def _refuse(self, refusal: Refusal) -> GenerateReply:
        metrics.REQUESTS_REFUSED.labels(reason=refusal.reason).inc()
        log.info("refused a generate request: %s: %s", refusal.reason, refusal.message)
        return GenerateReply(refused=refusal)

    async def dispatch(self, job: Job, answer: asyncio.Future[Refusal | None] | None = None) -> None:
        """Places the reply until it runs: a failed handoff (the decode worker full, gone, or the
        transfer broken) comes back here and the reply is placed again without that decode worker,
        at most `max_handoff_attempts` times; then it ends with an error event. `answer`, while
        unsettled: the caller still waits, and a local placement every worker refuses is settled
        with the refusal instead of an error event; anything else settles it None."""
        try:
            await self._dispatch(job, answer)
        finally:
            if answer is not None and not answer.done():
                answer.set_result(None)

    async def _dispatch(self, job: Job, answer: asyncio.Future[Refusal | None] | None) -> None:
        failures: list[str] = []
        excluded: set[str] = set()
        while True:
            if job.assignment.reply_id in self._cancels:
                await self._end_cancelled(job.assignment)
                return
            if job.remote is not None:
                remote = await self._dispatch_remote(job)
                if remote == _HANDED_OVER:
                    return
                if isinstance(remote, _HandoffFailed):
                    failures.append(remote.detail)
                    if remote.decode_worker_id:  # empty: the prefill side failed (it was stopping)
                        excluded.add(remote.decode_worker_id)
                    log.warning("the handoff of reply %s failed (%s)", job.assignment.reply_id, remote.detail)
                    job = self._plan(remote.assignment, job.model, frozenset(excluded), job.admitted_at_s)
                    if len(failures) < self._config.max_handoff_attempts and job.worker_ids:
                        continue
                    await self._end_failed(job.assignment, failures)
                    return
            await self._dispatch_local(job, answer)
            return

    async def _dispatch_remote(self, job: Job) -> str | _HandoffFailed:
        assert job.remote is not None
        remote_assignment, prefill_ids = job.remote
        reply_id = remote_assignment.reply_id
        self.outcomes.expect(reply_id)
        result = await dispatch(self._assign, remote_assignment, prefill_ids, self._config)
        self._note_refusals(remote_assignment, result)
        if result.accepted_by is None:
            self.outcomes.forget(reply_id)
            last = result.attempts[-1] if result.attempts else None
            if last is not None and last.failed_decode_worker_id:
                return _HandoffFailed(last.failed_decode_worker_id, job.assignment, last.describe())
            log.info("no prefill worker took reply %s (%s); prefilling locally", reply_id, last.describe() if last else "none live")
            return _PREFILL_LOCALLY
        _count_wait(job)
        log.debug("reply %s prefills on %s for %s", reply_id, result.accepted_by, remote_assignment.decode_worker_id)
        outcome = await self.outcomes.wait(reply_id, self._config.handoff_outcome_timeout_s)
        if outcome is None:
            log.warning("no handoff outcome for reply %s from %s; leaving it to stall detection", reply_id, result.accepted_by)
            return _HANDED_OVER
        if outcome.result != HandoffOutcome.RESULT_FAILED:
            return _HANDED_OVER
        detail = f"{outcome.prefill_worker_id} -> {outcome.decode_worker_id}: {outcome.reason}: {outcome.message}"
        return _HandoffFailed(outcome.decode_worker_id, continuation(job.assignment, list(outcome.published_token_ids)), detail)

    async def _dispatch_local(self, job: Job, answer: asyncio.Future[Refusal | None] | None = None) -> None:
        """Offers the reply to its decode workers in order; if none takes it, it is refused to the
        caller still waiting on `answer`, or else ends with an error event."""
        assignment = job.assignment
        num_tokens = num_context_tokens(assignment.request)
        result = await dispatch(
            self._assign,
            assignment,
            job.worker_ids,
            self._config,
            on_retry=lambda worker_id: self._workers.note_assigned(worker_id, num_tokens),
        )
        self._note_refusals(assignment, result)
        was_cancelled = any(a.refusal is not None and a.refusal.reason == "cancelled" for a in result.attempts)
        if result.accepted_by is None and (was_cancelled or assignment.reply_id in self._cancels):
            await self._end_cancelled(assignment)
            return
        if result.accepted_by is not None:
            _count_wait(job)
            log.debug("reply %s runs on %s", assignment.reply_id, result.accepted_by)
            return
        moved = self._moved_when_full(job, result)
        if moved is not None:
            await self._dispatch_local(moved, answer)
            return
        metrics.DISPATCH_FAILURES.inc()
        event = failure_event(assignment, result, self._config)
        if answer is not None and not answer.done():  # the caller hears it as a refusal: nothing to end
            log.info("reply %s refused at placement (%s): %s", assignment.reply_id, event.error.code, result.describe())
            self._versions.refused_at_placement(job.model, assignment.reply_id, event.error.code)
            answer.set_result(Refusal(reason=event.error.code, message=event.error.message, retry_after_s=event.error.retry_after_s))
            return
        log.warning("reply %s failed (%s): %s", assignment.reply_id, event.error.code, result.describe())
        await self._publish_event(event)

    def _moved_when_full(self, job: Job, result: DispatchResult) -> Job | None:
        """The reply placed on the large pool when every small worker offered it said its queue is
        too long for the lane (services.router.pools), and the large pool may start it; else None."""
        large = self._pools.when_full(job.model)
        if large is None or not result.attempts:
            return None
        if any(a.refusal is None or a.refusal.reason != QUEUE_FULL for a in result.attempts):
            return None
        workers = self._workers.workers(DECODE_ROLE)
        request = job.assignment.request
        other = self._versions.version_of(large, request, workers)
        if self._readmit(request, other, workers) is None or self._door(lane_of(request), other, workers) is not None:
            return None
        assignment = Assignment()
        assignment.CopyFrom(job.assignment)
        assignment.request.model = other
        count_fallback(job.model, other, FULL)
        log.info("reply %s: every %s worker is full; it goes to %s", assignment.reply_id, job.model, other)
        return self._plan(assignment, other, frozenset(), job.admitted_at_s)

    def _note_refusals(self, assignment: Assignment, result: DispatchResult) -> None:
        """Workers that said their queue is too long for the lane are offered its requests last
        until their retry time, and refused at the door while all of them say so."""
        lane = lane_of(assignment.request)
        for attempt in result.attempts:
            if attempt.refusal is not None and attempt.refusal.reason == QUEUE_FULL:
                metrics.LANE_REFUSALS.labels(lane=LANE_NAMES[lane]).inc()
                self.refusals.note(attempt.worker_id, lane, attempt.refusal.retry_after_s)

    async def _end_failed(self, assignment: Assignment, failures: list[str]) -> None:
        """A reply whose handoffs all failed ends with one error event, after what was published."""
        metrics.DISPATCH_FAILURES.inc()
        message = "the reply could not be handed between workers; try again shortly"
        event = error_event(
            assignment.reply_id, assignment.first_seq or 1, "handoff_failed", message, retry_after_s=self._config.retry_after_s
        )
        event.epoch = assignment.epoch
        log.warning("reply %s failed: the KV handoff failed %d times: %s", assignment.reply_id, len(failures), "; ".join(failures))
        await self._publish_event(event)

    async def _publish_event(self, event: TokenEvent) -> None:
        """A final event of the router's own, retried a few times (JetStream stores it once: its
        message id is reply, epoch and seq)."""
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                await self._publish_event_once(event)
                return
            except Exception:  # a task's exception would otherwise go unseen
                log.exception("could not publish the final event of reply %s (attempt %d of %d)", event.reply_id, attempt, PUBLISH_ATTEMPTS)

    async def _end_cancelled(self, assignment: Assignment) -> None:
        """A reply cancelled before any worker ran it ends here, with its one (cancelled) event."""
        event = cancelled_event(assignment.reply_id, assignment.first_seq or 1)
        event.epoch = assignment.epoch
        await self._publish_event(event)

    async def wait_idle(self, timeout_s: float) -> None:
        """For shutdown: lets dispatches in flight finish, then cancels what is left."""
        pending = set(self._dispatching)
        if not pending:
            return
        _, still_running = await asyncio.wait(pending, timeout=timeout_s)
        for task in still_running:
            task.cancel()
        if still_running:
            log.warning("cancelled %d dispatches at shutdown", len(still_running))


def _count_wait(job: Job) -> None:
    """A worker accepted the job: how long it waited since its admission."""
    wait_s = time.monotonic() - job.admitted_at_s
    metrics.DISPATCH_SECONDS.observe(wait_s)
    metrics.QUEUE_WAIT.labels(lane=LANE_NAMES[lane_of(job.assignment.request)]).observe(wait_s)
