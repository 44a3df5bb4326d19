"""`tandem.v1.generate`: admit or refuse at once, answer with the reply id, then hand the reply
over in the background: to a prefill worker naming the chosen decode worker when the uncached
prompt is long (disaggregated), else to the decode worker itself (local prefill). If no prefill
worker takes it, the decode workers are offered it with local prefill."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.msg import Msg

from services.router import metrics
from services.router.admission import admit, parse_request
from services.router.dispatch import Assign, DispatchConfig, dispatch, failure_event
from services.router.placement import Placement, affinity_key, num_context_tokens
from services.router.workers import LiveWorker, WorkerRegistry
from tandem.bus import encode, subjects
from tandem.cancels import RecentCancels
from tandem.v1.common_pb2 import FINISH_REASON_CANCELLED
from tandem.v1.dispatch_pb2 import Assignment
from tandem.v1.generate_pb2 import GenerateReply, Refusal
from tandem.v1.tokens_pb2 import TokenEvent

DECODE_ROLE = "decode"
PREFILL_ROLE = "prefill"
log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], Awaitable[None]]


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


class GenerateService:
    def __init__(
        self,
        workers: WorkerRegistry,
        placement: Placement,
        assign: Assign,
        publish: Publish,
        config: DispatchConfig = DispatchConfig(),
    ) -> None:
        self._workers = workers
        self._placement = placement
        self._assign = assign
        self._publish = publish
        self._config = config
        self._dispatching: set[asyncio.Task[None]] = set()
        self._cancels = RecentCancels()

    async def on_cancel(self, msg: Msg) -> None:
        """A cancel may come before the reply reaches any worker: remember it."""
        self._cancels.note(subjects.reply_id_of(msg.subject))

    async def on_request(self, msg: Msg) -> None:
        """The NATS callback: never raises, whatever the payload."""
        if not msg.reply:
            log.warning("dropped a generate message without a reply subject (send it as a request)")
            return
        reply, job = self.handle(msg.data)
        await msg.respond(encode(reply))
        if job is not None:
            task = asyncio.create_task(self.dispatch(job), name=f"dispatch:{job.assignment.reply_id}")
            self._dispatching.add(task)
            task.add_done_callback(self._dispatching.discard)

    def handle(self, data: bytes) -> tuple[GenerateReply, Job | None]:
        """The answer to one generate payload, and the dispatch job when it was admitted."""
        request = parse_request(data)
        if isinstance(request, Refusal):
            return self._refuse(request), None
        decode_workers = self._workers.workers(DECODE_ROLE)
        admitted = admit(request, decode_workers)
        if isinstance(admitted, Refusal):
            return self._refuse(admitted), None
        # A continuation keeps its reply id and numbering: the logged tokens come first.
        reply_id = request.resume_reply_id or request.reply_id or new_reply_id()
        assignment = Assignment(reply_id=reply_id, request=request, first_seq=len(request.generated_token_ids) + 1)
        ranked = self._placement.rank(decode_workers, admitted.model, request, affinity_key(request, reply_id))
        if ranked:
            # Counted from the moment it is chosen, so a burst spreads before any worker answers.
            self._workers.note_assigned(ranked[0].instance_id, num_context_tokens(request))
        metrics.REQUESTS_ACCEPTED.labels(model=admitted.model).inc()
        job = Job(assignment, tuple(w.instance_id for w in ranked), time.monotonic(), self._remote(assignment, ranked, admitted.model))
        return GenerateReply(reply_id=reply_id, model=admitted.model), job

    def _remote(self, assignment: Assignment, ranked_decode: list[LiveWorker], model: str) -> tuple[Assignment, tuple[str, ...]] | None:
        if not ranked_decode or not self._placement.should_prefill_remotely(ranked_decode[0], assignment.request):
            return None
        key = affinity_key(assignment.request, assignment.reply_id)
        prefill = self._placement.rank(self._workers.workers(PREFILL_ROLE), model, assignment.request, key)
        if not prefill:
            return None
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

    async def dispatch(self, job: Job) -> None:
        """Offers the job to its workers in order; if none takes it, the reply ends with an error event."""
        assignment = job.assignment
        num_tokens = num_context_tokens(assignment.request)
        if assignment.reply_id in self._cancels:
            await self._end_cancelled(assignment)
            return
        if job.remote is not None:
            remote_assignment, prefill_ids = job.remote
            remote = await dispatch(self._assign, remote_assignment, prefill_ids, self._config)
            if remote.accepted_by is not None:
                metrics.DISPATCH_SECONDS.observe(time.monotonic() - job.admitted_at_s)
                log.debug("reply %s prefills on %s for %s", assignment.reply_id, remote.accepted_by, remote_assignment.decode_worker_id)
                return
            log.info("no prefill worker took reply %s (%s); prefilling locally", assignment.reply_id, remote.attempts[-1].describe())
        result = await dispatch(
            self._assign,
            assignment,
            job.worker_ids,
            self._config,
            on_retry=lambda worker_id: self._workers.note_assigned(worker_id, num_tokens),
        )
        was_cancelled = any(a.refusal is not None and a.refusal.reason == "cancelled" for a in result.attempts)
        if result.accepted_by is None and (was_cancelled or assignment.reply_id in self._cancels):
            await self._end_cancelled(assignment)
            return
        if result.accepted_by is not None:
            metrics.DISPATCH_SECONDS.observe(time.monotonic() - job.admitted_at_s)
            log.debug("reply %s runs on %s", assignment.reply_id, result.accepted_by)
            return
        metrics.DISPATCH_FAILURES.inc()
        event = failure_event(assignment, result, self._config)
        log.warning("reply %s failed: %s", assignment.reply_id, event.error.message)
        try:
            await self._publish(subjects.tokens(assignment.reply_id), encode(event))
        except Exception:  # a task's exception would otherwise go unseen
            log.exception("could not publish the error event of reply %s", assignment.reply_id)

    async def _end_cancelled(self, assignment: Assignment) -> None:
        """A reply cancelled before any worker ran it ends here, with its one (cancelled) event."""
        event = TokenEvent(reply_id=assignment.reply_id, seq=assignment.first_seq or 1, finish=FINISH_REASON_CANCELLED)
        await self._publish(subjects.tokens(assignment.reply_id), encode(event))

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
