"""Stall detection and continuation: a running reply whose worker is lost is resubmitted to the
router with the tokens already logged, under a new owner epoch, so the client sees a pause and
then the rest of the answer.

Workers list in every heartbeat the replies they hold, and every service answers a ping. A
claimed reply silent for a quarter of a second gets its worker pinged: "no responders" means the
process is gone (NATS dropped its subscriptions with its connection), and its replies are
continued at once. Otherwise a running reply is stalled when no live
worker has claimed it within the stall timeout and its current owner makes no progress: no event
logged for the stall timeout since it produced one; or, while it has produced nothing yet, a
worker claimed it since it was dispatched and stopped (lost before its first token), or nobody
claimed it for the dispatch grace since it was created or last continued (the router may still
be placing it).
Every relay watches every reply; the epoch bump, guarded by the epoch and last seq the relay saw,
lets exactly one of them act. After `max_continuations` the reply ends with an error event
instead, and its turn is stored as failed with its partial text."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import partial

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from redis.asyncio import Redis

from services.relay import metrics
from tandem import model_ids
from tandem.bus import encode, subjects, validate
from tandem.bus.events import error_event, now_ms
from tandem.tokenlog import ReplyMeta, begin_continuation, fence_reply, load_reply
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.v1.worker_pb2 import WorkerHeartbeat

log = logging.getLogger(__name__)

PublishFinal = Callable[[TokenEvent], Awaitable[None]]
WORKER_ROLES = ("prefill", "decode")
PING_AFTER_SILENT_S = 0.25  # a claimed reply silent this long gets its worker pinged (a live one just answers)
PING_TIMEOUT_S = 1.0
HARD_SILENCE_S = 60.0  # a reply silent and unclaimed this long is stalled even while no worker is heard
LOST_CODE = "worker_lost"
LOST_MESSAGE = (
    "The worker writing this reply was lost and it could not be continued elsewhere; regenerate the reply or send the message again."
)


@dataclass(frozen=True)
class StallConfig:
    stall_timeout_s: float
    dispatch_grace_s: float
    max_continuations: int
    running_ttl_s: int
    request_timeout_s: float = 5.0  # for the router's answer to a continuation


class Claims:
    """Which replies live workers claimed lately, from their heartbeats (the time each was heard)."""

    def __init__(self, clock: Callable[[], int] = now_ms, deaf_gap_ms: int = 2000) -> None:
        self._clock = clock  # unix ms
        self._claimed_ms: dict[str, int] = {}
        self._listening_since_ms = 0
        # No heartbeat from any worker for this long: the bus (or this relay) is cut off, not every
        # worker lost at once; the claims count again only after a fresh round of heartbeats.
        self._deaf_gap_ms = deaf_gap_ms
        self._last_heard_ms = 0
        self._claimer: dict[str, str] = {}  # reply id -> the worker that claimed it last
        # reply id -> when a ping found the process of the worker that last claimed it gone; kept
        # when that worker restarts under the same id (it comes back without its replies)
        self._lost_ms: dict[str, int] = {}

    async def listen(self, client: Client) -> None:
        for role in WORKER_ROLES:
            await client.subscribe(subjects.heartbeats_of(role), cb=self._on_heartbeat)
        self._listening_since_ms = self._clock()

    def observe_connection(self, is_connected: bool) -> None:
        """While NATS is down this relay hears no heartbeat: once it is back, the claims count
        again only after a fresh round of them."""
        if not is_connected:
            self._listening_since_ms = 0
        elif self._listening_since_ms == 0:
            self._listening_since_ms = self._clock()

    def has_listened_for_ms(self, duration_ms: int) -> bool:
        """A relay that just started, or just got NATS back, has not heard every worker yet: it
        must not call a reply unclaimed."""
        return self._listening_since_ms > 0 and self._clock() - self._listening_since_ms >= duration_ms

    def is_hearing(self, within_ms: int) -> bool:
        """Some worker's heartbeat arrived within `within_ms`: silence about a reply means something."""
        return self._clock() - self._last_heard_ms <= within_ms

    def note(self, heartbeat: WorkerHeartbeat) -> None:
        heard_ms = self._clock()
        if self._listening_since_ms and heard_ms - self._last_heard_ms > self._deaf_gap_ms:
            self._listening_since_ms = heard_ms  # back from a silence (NATS paused): a fresh round first
        self._last_heard_ms = heard_ms
        worker_id = heartbeat.service.instance_id
        for reply_id in heartbeat.reply_ids:
            self._claimed_ms[reply_id] = heard_ms
            self._claimer[reply_id] = worker_id

    def claimer(self, reply_id: str) -> str:
        """The worker that claimed the reply last ("" when none did lately)."""
        return self._claimer.get(reply_id, "")

    def note_gone(self, worker_id: str) -> None:
        """A ping found the worker's process gone: the replies it claimed are lost, and its claims
        of them stop counting at once (a later claim, by whoever takes them on, counts again)."""
        gone_ms = self._clock()
        for reply_id, claimer in self._claimer.items():
            if claimer == worker_id:
                self._lost_ms[reply_id] = gone_ms

    def lost_ms(self, reply_id: str) -> int:
        """When the worker that claimed the reply last was found gone (unix ms); 0 when it was not."""
        return self._lost_ms.get(reply_id, 0)

    def is_claimed(self, reply_id: str, within_ms: int) -> bool:
        claimed_ms = self._claimed_ms.get(reply_id, 0)
        if self._lost_ms.get(reply_id, 0) >= claimed_ms:
            return False  # its claimer was found gone after it last claimed it
        return self._clock() - claimed_ms <= within_ms

    def last_claimed_ms(self, reply_id: str) -> int:
        """When a worker last claimed the reply (unix ms); 0 when none did lately."""
        return self._claimed_ms.get(reply_id, 0)

    def forget_older_than(self, age_ms: int) -> None:
        cutoff_ms = self._clock() - age_ms
        for reply_id in [r for r, heard_ms in self._claimed_ms.items() if heard_ms < cutoff_ms]:
            del self._claimed_ms[reply_id]
            self._claimer.pop(reply_id, None)
        for reply_id in [r for r, lost_ms in self._lost_ms.items() if lost_ms < cutoff_ms]:
            del self._lost_ms[reply_id]

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            self.note(validate.worker_heartbeat(msg.data, msg.subject))
        except validate.Invalid as exc:
            validate.drop("heartbeat", msg.subject, exc)


def is_stalled(meta: ReplyMeta, claims: Claims, config: StallConfig, now: int) -> bool:
    """The reply's worker is lost: nobody claims it, and its current owner makes no progress (`now`: unix ms).
    While this relay hears no worker at all (the bus is cut off, or no worker runs), only a reply
    silent for `HARD_SILENCE_S` counts as stalled, so a bus outage does not spend every reply's
    continuations while no worker can be reached, and no reply waits forever."""
    stall_ms = int(config.stall_timeout_s * 1000)
    if not meta.is_running or meta.cancel_sent_ms:
        return False  # ended, or cancelled for want of readers: the sweep closes it
    if claims.is_claimed(meta.reply_id, stall_ms):
        return False
    if claims.lost_ms(meta.reply_id) > meta.dispatched_ms and claims.last_claimed_ms(meta.reply_id) > meta.dispatched_ms:
        # The worker that took it in its current epoch is gone (a ping found nobody answering): no
        # need to wait out the silence. Events logged after that were its backlog (the relay may lag behind the bus);
        # any still on the way are of the old epoch once the continuation begins, and dropped.
        return True
    if now - max(meta.last_event_ms, meta.dispatched_ms) > HARD_SILENCE_S * 1000:
        return True
    if not claims.has_listened_for_ms(stall_ms) or not claims.is_hearing(stall_ms):
        return False
    if meta.last_event_ms > meta.dispatched_ms:  # its current owner has produced: it must keep producing
        return now - meta.last_event_ms > stall_ms
    if claims.last_claimed_ms(meta.reply_id) > meta.dispatched_ms:
        return True  # a worker took it (claimed it since it was dispatched) and no longer does: lost before its first token
    return now - meta.dispatched_ms > config.dispatch_grace_s * 1000


class StallWatcher:
    def __init__(self, redis: Redis, client: Client, claims: Claims, publish_final: PublishFinal, config: StallConfig) -> None:
        self._redis = redis
        self._client = client
        self._claims = claims
        self._publish_final = publish_final
        self._config = config
        self._acting: dict[str, asyncio.Task[None]] = {}  # reply id -> its continuation or failure in flight
        self._pinging: dict[str, asyncio.Task[None]] = {}  # worker id -> its ping in flight
        # Set when a ping found a worker gone: the next check runs at once, not an interval later.
        self.found_gone = asyncio.Event()

    def check(self, metas: Iterable[ReplyMeta]) -> None:
        """Acts on every stalled reply, each in a task of its own (a router's answer can take seconds);
        pings the worker of each reply that has been silent a moment, so a dead worker is known
        at once instead of after the stall timeout."""
        self._claims.observe_connection(self._client.is_connected)
        self._claims.forget_older_than(int(self._config.stall_timeout_s * 1000) * 4)
        now = now_ms()
        for meta in metas:
            # Only a worker that claimed the reply in its current epoch (since it was dispatched) is
            # pinged: the previous owner of a continued reply is gone already, and finding it gone
            # again must not make the continuation look lost.
            silent = meta.is_running and now - max(meta.last_event_ms, meta.dispatched_ms) > PING_AFTER_SILENT_S * 1000
            if silent and self._claims.last_claimed_ms(meta.reply_id) > meta.dispatched_ms:
                self._ping(self._claims.claimer(meta.reply_id))
            if meta.reply_id in self._acting or not is_stalled(meta, self._claims, self._config, now):
                continue
            metrics.STALLS.inc()
            act = self._end if meta.num_continuations >= self._config.max_continuations else self._continue
            task = asyncio.create_task(act(meta), name=f"stall:{meta.reply_id}")
            self._acting[meta.reply_id] = task
            task.add_done_callback(partial(self._done, meta.reply_id))

    async def stop(self) -> None:
        tasks = [*self._acting.values(), *self._pinging.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _ping(self, worker_id: str) -> None:
        if not worker_id or worker_id in self._pinging:
            return
        task = asyncio.create_task(self._ping_once(worker_id), name=f"ping:{worker_id}")
        self._pinging[worker_id] = task
        task.add_done_callback(lambda _: self._pinging.pop(worker_id, None))

    async def _ping_once(self, worker_id: str) -> None:
        """ "No responders" means NATS holds no subscription of the worker: its process is gone. A
        worker that answers, or does not answer in time (frozen, busy), is left to the stall rule."""
        try:
            await self._client.request(subjects.ping(worker_id), b"", timeout=PING_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            log.warning("worker %s is gone (nothing answers its ping); its replies are continued now", worker_id)
            metrics.WORKERS_GONE.inc()
            self._claims.note_gone(worker_id)
            self.found_gone.set()
        except (nats.errors.Error, TimeoutError):
            pass

    def _done(self, reply_id: str, task: asyncio.Task[None]) -> None:
        self._acting.pop(reply_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("reply %s: acting on its stall failed", reply_id, exc_info=task.exception())

    async def _continue(self, seen: ReplyMeta) -> None:
        meta = await load_reply(self._redis, seen.reply_id)
        if meta is None or not meta.request:
            await self._end(seen)  # nothing to resubmit: a reply recorded without its request
            return
        continuation = await begin_continuation(
            self._redis, seen.reply_id, expected_epoch=seen.epoch, expected_last_seq=seen.last_seq, ttl_s=self._config.running_ttl_s
        )
        if continuation is None:
            return  # another relay took it, or it moved on meanwhile
        request = continuation_request(meta, continuation.token_ids, continuation.epoch)
        log.warning(
            "reply %s stalled after %d tokens; continuing it (epoch %d, continuation %d of %d)",
            seen.reply_id,
            len(continuation.token_ids),
            continuation.epoch,
            seen.num_continuations + 1,
            self._config.max_continuations,
        )
        try:
            answer = await self._client.request(subjects.GENERATE, encode(request), timeout=self._config.request_timeout_s)
            outcome = validate.generate_reply(answer.data)
        except (nats.errors.Error, TimeoutError, validate.Invalid) as exc:  # no router, none answered in time, or a garbled answer
            metrics.CONTINUATIONS.labels(outcome="unanswered").inc()
            log.warning("reply %s: no router took its continuation (%s); it is tried again", seen.reply_id, exc or type(exc).__name__)
            return
        if outcome.WhichOneof("outcome") == "refused":
            metrics.CONTINUATIONS.labels(outcome="refused").inc()
            log.warning("reply %s: the router refused its continuation: %s", seen.reply_id, outcome.refused.reason)
            return
        metrics.CONTINUATIONS.labels(outcome="accepted").inc()

    async def _end(self, seen: ReplyMeta) -> None:
        """Ends the reply with an error event of the relay's own, under an epoch no worker has."""
        taken = await fence_reply(self._redis, seen.reply_id, expected_epoch=seen.epoch, ttl_s=self._config.running_ttl_s)
        if taken is None:
            return
        log.error("reply %s: still lost after %d continuations; ending it with an error", seen.reply_id, seen.num_continuations)
        event = error_event(seen.reply_id, taken.last_seq + 1, LOST_CODE, LOST_MESSAGE, worker_id="relay")
        event.epoch = taken.epoch
        await self._publish_final(event)
        metrics.REPLIES_LOST.inc()


def continuation_request(meta: ReplyMeta, token_ids: list[int], epoch: int) -> GenerateRequest:
    """The reply's request as first sent, resumed after `token_ids` (those logged) by owner
    `epoch`. On the model that answered it: the version the routers' rollout gave it (recorded
    by set_answered), not a new draw between versions, so one model writes the whole reply."""
    request = GenerateRequest.FromString(meta.request)
    request.reply_id = request.resume_reply_id = meta.reply_id
    if model_ids.is_versioned(meta.model) and not model_ids.is_versioned(request.model):
        request.model = meta.model
    del request.generated_token_ids[:]
    request.generated_token_ids.extend(token_ids)
    request.epoch = epoch
    return request
