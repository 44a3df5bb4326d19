"""The router as a real process against a real nats-server: admission and refusals over
`tandem.v1.generate`, placement by load and by cached prefix (KV events, and a worker's state
fetched on a gap), and dispatch with retries to decode workers.

The decode workers here are stand-ins written in the test: real NATS clients that heartbeat like
a decode worker and answer Assignments as told, so each path is driven exactly."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import nats.errors
import nats.js.errors
import pytest_asyncio
from helpers import next_heartbeat, ops_url, service_env, service_process
from nats.aio.client import Client
from nats.aio.msg import Msg

from tandem.bus import decode, encode, subjects
from tandem.bus.events import now_ms
from tandem.bus.token_stream import STREAM
from tandem.devstack.proc import ChildProcess
from tandem.devstack.servers import EmbeddedServer
from tandem.engine.block_hash import prefix_block_hashes
from tandem.v1.common_pb2 import FINISH_REASON_ERROR, LANE_FREE, LANE_PAID, LaneCounts
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest, Refusal
from tandem.v1.kv_pb2 import BlocksStored, KvEvent, KvState, KvStateRequest, StoredBlock
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.v1.worker_pb2 import LadderStatus, ServiceHeartbeat, WorkerHeartbeat

MODEL = "SmolLM2-135M-Instruct"
WINDOW = 8192
HEARTBEAT_INTERVAL_S = 0.2
WAIT_S = 10.0
LADDER_INTERVAL_S = 0.2  # the ladder observes this often here (10 s in production)
LADDER_START_DEADLINE_S = 1.0

ACCEPT = "accept"
REFUSE = "refuse"
QUEUE_FULL = "queue_full"  # refuses as a worker whose queue is too long for the lane
SILENT = "silent"  # subscribed, never answers: the router times out
DEAF = "deaf"  # not subscribed at all: the router gets "no responders"


@dataclass
class Router:
    child: ChildProcess
    url: str  # its /workers
    instance_id: str
    ops_url: str  # its /metrics


async def start_router(nats_server: EmbeddedServer, redis_server: EmbeddedServer, nc: Client, **extra_env: str) -> Router:
    env = service_env(
        "router",
        nats_server.url,
        redis_server.url,
        TANDEM_LADDER_INTERVAL_S=str(LADDER_INTERVAL_S),
        TANDEM_LADDER_START_DEADLINE_S=str(LADDER_START_DEADLINE_S),
        TANDEM_CPU_TTFT_SCALE="1",  # the GPU targets, whatever the router takes the fleet to be
        **extra_env,
    )
    child = service_process("router", env)
    child.start()
    router = Router(child, f"http://127.0.0.1:{env['TANDEM_HTTP_PORT']}", env["TANDEM_INSTANCE_ID"], ops_url(env))
    # Ready means subscribed to heartbeats and generate, and flushed to the server.
    await next_heartbeat(nc, "router", router.instance_id, accept=lambda hb: hb.is_ready, timeout_s=30)
    return router


@pytest_asyncio.fixture
async def router(nats_server, redis_server, nc) -> AsyncIterator[Router]:
    started = await start_router(nats_server, redis_server, nc)
    yield started
    started.child.stop(timeout_s=10)


class StandInWorker:
    """A decode worker as the router sees it: heartbeats with a fixed load, and Assignments
    answered by `answer`."""

    def __init__(
        self,
        nc: Client,
        answer: str = ACCEPT,
        *,
        num_running: int = 0,
        is_engine_ready: bool = True,
        kv_blocks_free: int = 1024,
        estimated_wait_s: float = 0.0,
        retry_after_s: float = 1.5,
        model: str = MODEL,
    ) -> None:
        self.nc = nc
        self.instance_id = f"decode-standin-{uuid.uuid4().hex[:8]}"
        self.answer = answer
        self.retry_after_s = retry_after_s
        self.heartbeat = WorkerHeartbeat(
            service=ServiceHeartbeat(role="decode", instance_id=self.instance_id, is_ready=True, interval_s=HEARTBEAT_INTERVAL_S),
            model=model,
            kv_block_size=16,
            kv_blocks_total=1024,
            kv_blocks_free=kv_blocks_free,
            estimated_wait_s=estimated_wait_s,
            running=LaneCounts(paid=num_running),
            waiting=LaneCounts(),
            max_model_len=WINDOW if is_engine_ready else 0,
            is_engine_ready=is_engine_ready,
        )
        self.assignments: asyncio.Queue[Assignment] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        if self.answer != DEAF:
            await self.nc.subscribe(subjects.assign(self.instance_id), cb=self._on_assignment)
            await self.nc.flush()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _heartbeat_loop(self) -> None:
        while True:
            self.heartbeat.service.sent_unix_ms = now_ms()
            await self.nc.publish(subjects.heartbeat("decode", self.instance_id), encode(self.heartbeat))
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)  # the heartbeat period, not a wait for an event

    async def _on_assignment(self, msg: Msg) -> None:
        await self.assignments.put(decode(msg.data, Assignment))
        if self.answer == ACCEPT:
            await msg.respond(encode(AssignmentReply(accepted=True)))
        elif self.answer == REFUSE:
            refusal = Refusal(reason="overloaded", message=f"{self.instance_id} is full", retry_after_s=self.retry_after_s)
            await msg.respond(encode(AssignmentReply(refused=refusal)))
        elif self.answer == QUEUE_FULL:
            refusal = Refusal(reason="queue_full", message="the wait is over the lane's target", retry_after_s=self.retry_after_s)
            await msg.respond(encode(AssignmentReply(refused=refusal)))

    async def next_assignment(self) -> Assignment:
        return await asyncio.wait_for(self.assignments.get(), WAIT_S)


@pytest_asyncio.fixture
async def stand_in(nc) -> AsyncIterator[Callable]:
    workers: list[StandInWorker] = []

    async def start(answer: str = ACCEPT, **load: object) -> StandInWorker:
        worker = StandInWorker(nc, answer, **load)
        await worker.start()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        await worker.stop()


async def wait_until_router_lists(router: Router, *workers: StandInWorker) -> None:
    """Until the router has a heartbeat from each (a bounded poll of its /workers listing)."""
    expected = {w.instance_id: w.heartbeat.is_engine_ready for w in workers}
    deadline = time.monotonic() + WAIT_S
    async with httpx.AsyncClient(base_url=router.url) as http:
        while True:
            listed = {w["instance_id"]: w["engine_ready"] for w in (await http.get("/workers")).json()["decode"]}
            if all(listed.get(i) == ready for i, ready in expected.items()):
                return
            assert time.monotonic() < deadline, f"the router lists {listed}, not {expected}"
            await asyncio.sleep(0.05)


def generate_request(num_prompt_tokens: int = 12, model: str = MODEL, **fields: object) -> GenerateRequest:
    request = GenerateRequest(
        request_id=uuid.uuid4().hex,
        model=model,
        user_id="u1",
        tenant="t1",
        prompt_token_ids=list(range(1, num_prompt_tokens + 1)),
        **fields,
    )
    request.sampling.max_tokens = 32
    request.sampling.temperature = 0.7
    return request


async def ask(nc: Client, payload: GenerateRequest | bytes) -> GenerateReply:
    data = payload if isinstance(payload, bytes) else encode(payload)
    return decode((await nc.request(subjects.GENERATE, data, timeout=WAIT_S)).data, GenerateReply)


async def ask_refused(nc: Client, payload: GenerateRequest | bytes) -> Refusal:
    reply = await ask(nc, payload)
    assert reply.WhichOneof("outcome") == "refused", reply
    return reply.refused


async def ask_accepted(nc: Client, payload: GenerateRequest) -> GenerateReply:
    reply = await ask(nc, payload)
    assert reply.WhichOneof("outcome") == "reply_id", reply
    return reply


async def test_a_router_started_under_load_takes_requests_only_once_it_has_heard_a_decode_worker(nats_server, redis_server, stand_in, nc):
    """A rolling restart of the router: the worker heartbeats already, and requests arrive while
    the router starts. Its first answer is a placement, never a no_workers refusal (before it
    subscribes, a request finds no responders, and the chat sends it again)."""
    await stand_in()
    env = service_env("router", nats_server.url, redis_server.url)
    child = service_process("router", env)
    child.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                reply = await ask(nc, generate_request())
                break
            except nats.errors.NoRespondersError:
                assert time.monotonic() < deadline and child.poll() is None, child.recent_output(20)
        assert reply.WhichOneof("outcome") == "reply_id", reply
    finally:
        child.stop(timeout_s=10)


async def test_a_router_with_no_decode_worker_takes_requests_after_a_few_heartbeat_intervals(router, nc):
    assert router.child.wait_for_line(r"no decode worker heard within \d", timeout_s=10) is not None
    assert (await ask_refused(nc, generate_request())).reason == "no_workers"


async def test_a_request_runs_once_on_the_least_loaded_worker(router, stand_in, nc):
    busy = await stand_in(num_running=5)
    idle = await stand_in(num_running=1)
    await wait_until_router_lists(router, busy, idle)
    request = generate_request(conversation_id="conv-1")
    reply = await ask_accepted(nc, request)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", reply.reply_id)
    assert reply.model == MODEL
    asked_ms = now_ms()
    assignment = await idle.next_assignment()
    assert assignment.reply_id == reply.reply_id
    assert assignment.request == request
    assert assignment.first_seq == 1
    # A worker must answer before the router stops waiting (2 s), with a margin for the way back.
    assert asked_ms - 5000 < assignment.accept_by_unix_ms < now_ms() + 2000
    # A later request's assignment is a barrier: by then the first went out once, to idle only.
    await ask_accepted(nc, generate_request(conversation_id="conv-2"))
    await idle.next_assignment()
    assert busy.assignments.empty() and idle.assignments.empty()


async def test_auto_gets_the_model_the_workers_serve(router, stand_in, nc):
    worker = await stand_in()
    await wait_until_router_lists(router, worker)
    reply = await ask_accepted(nc, generate_request(model="auto"))
    assert reply.model == MODEL
    assert (await worker.next_assignment()).reply_id == reply.reply_id


async def test_a_refusing_worker_sends_the_reply_to_the_next(router, stand_in, nc):
    refuser = await stand_in(REFUSE, num_running=0)
    acceptor = await stand_in(ACCEPT, num_running=3)
    await wait_until_router_lists(router, refuser, acceptor)
    reply = await ask_accepted(nc, generate_request())
    assert (await refuser.next_assignment()).reply_id == reply.reply_id
    assert (await acceptor.next_assignment()).reply_id == reply.reply_id


async def test_silent_and_unsubscribed_workers_are_skipped(router, stand_in, nc):
    silent = await stand_in(SILENT, num_running=0)
    deaf = await stand_in(DEAF, num_running=1)
    acceptor = await stand_in(ACCEPT, num_running=2)
    await wait_until_router_lists(router, silent, deaf, acceptor)
    reply = await ask_accepted(nc, generate_request())
    assert (await silent.next_assignment()).reply_id == reply.reply_id
    assert (await acceptor.next_assignment()).reply_id == reply.reply_id  # after the 2 s timeout


async def test_a_reply_every_worker_refuses_is_refused_to_the_caller_with_their_reason(router, stand_in, nc):
    """Its answer waits for the placement: the client gets a refusal at the door (503), not an
    accepted reply that then ends with an error event."""
    first, second = await stand_in(REFUSE), await stand_in(REFUSE, num_running=1)
    await wait_until_router_lists(router, first, second)
    request = generate_request(reply_id=uuid.uuid4().hex)
    refusal = await ask_refused(nc, request)
    assert refusal.reason == "overloaded"
    assert first.instance_id not in refusal.message and second.instance_id not in refusal.message
    assert refusal.retry_after_s == 1.5
    assert (await first.next_assignment()).reply_id == (await second.next_assignment()).reply_id == request.reply_id


async def test_a_continuation_is_assigned_in_its_epoch_and_the_routers_error_goes_through_the_token_stream(router, stand_in, nc):
    """The relay's continuation: the logged tokens as generated tokens, a new owner epoch. Every
    worker refuses, so the router ends the reply itself, in that epoch, on JetStream."""
    refusing = await stand_in(REFUSE)
    await wait_until_router_lists(router, refusing)
    reply_id = uuid.uuid4().hex
    request = generate_request(reply_id=reply_id, resume_reply_id=reply_id, generated_token_ids=[7, 8, 9], epoch=2)
    await ask_accepted(nc, request)
    assignment = await refusing.next_assignment()
    assert (assignment.reply_id, assignment.first_seq, assignment.epoch) == (reply_id, 4, 2)
    js = nc.jetstream()
    deadline = time.monotonic() + WAIT_S
    while True:  # bounded: the router publishes once the last worker has refused
        try:
            stored = await js.get_last_msg(STREAM, subjects.final(reply_id))
            break
        except nats.js.errors.NotFoundError:
            assert time.monotonic() < deadline, "no final event on the token stream"
            await asyncio.sleep(0.05)
    event = decode(stored.data, TokenEvent)
    assert (event.seq, event.finish, event.epoch, event.error.code) == (4, FINISH_REASON_ERROR, 2, "overloaded")
    assert stored.headers is not None and stored.headers.get("Nats-Msg-Id") == f"{reply_id}:2:4"


async def test_each_invalid_request_is_refused_with_its_reason(router, stand_in, nc):
    worker = await stand_in()
    await wait_until_router_lists(router, worker)
    empty = await ask_refused(nc, generate_request(num_prompt_tokens=0))
    assert empty.reason == "empty_prompt"
    unknown = await ask_refused(nc, generate_request(model="gpt-9"))
    assert unknown.reason == "unknown_model"
    assert f"models served: {MODEL}" in unknown.message
    too_long = await ask_refused(nc, generate_request(num_prompt_tokens=WINDOW))
    assert too_long.reason == "prompt_too_long"
    assert f"the prompt has {WINDOW} tokens; {MODEL} takes at most {WINDOW - 1}" in too_long.message
    no_room = generate_request()
    no_room.sampling.max_tokens = WINDOW + 1
    assert (await ask_refused(nc, no_room)).reason == "bad_max_tokens"
    assert worker.assignments.empty()  # refused requests never reach a worker
    async with httpx.AsyncClient(base_url=router.url) as http:
        body = (await http.get(f"{router.ops_url}/metrics")).text
    for reason in ("empty_prompt", "unknown_model", "prompt_too_long", "bad_max_tokens"):
        assert f'tandem_router_requests_refused_total{{reason="{reason}"}} 1.0' in body


async def test_without_a_worker_that_takes_work_requests_are_refused_with_a_retry(router, stand_in, nc):
    refusal = await ask_refused(nc, generate_request())
    assert (refusal.reason, refusal.retry_after_s) == ("no_workers", 2.0)
    loading = await stand_in(is_engine_ready=False)
    await wait_until_router_lists(router, loading)
    refusal = await ask_refused(nc, generate_request(model="auto"))
    assert refusal.reason == "no_workers"
    assert f"no decode worker for {MODEL} takes work now" in refusal.message
    assert refusal.retry_after_s == 2.0


async def test_a_garbage_payload_is_a_bad_request_and_the_router_keeps_serving(router, stand_in, nc):
    worker = await stand_in()
    await wait_until_router_lists(router, worker)
    refusal = await ask_refused(nc, b"\x0a\xff\x01garbage")
    assert refusal.reason == "bad_request"
    assert "not a valid tandem.v1.GenerateRequest" in refusal.message
    reply = await ask_accepted(nc, generate_request())
    assert (await worker.next_assignment()).reply_id == reply.reply_id
    assert router.child.poll() is None


async def test_routers_in_one_queue_group_answer_each_request_once(router, stand_in, nc, nats_server, redis_server):
    second = await start_router(nats_server, redis_server, nc)
    try:
        worker = await stand_in()
        await wait_until_router_lists(router, worker)
        await wait_until_router_lists(second, worker)
        reply_ids = {(await ask_accepted(nc, generate_request())).reply_id for _ in range(8)}
        assigned = [(await worker.next_assignment()).reply_id for _ in range(8)]
        assert sorted(assigned) == sorted(reply_ids) and len(reply_ids) == 8
    finally:
        second.child.stop(timeout_s=10)


async def wait_until_router_indexed(router: Router, worker: StandInWorker, event_id: int) -> None:
    """Until the router's prefix index has applied the worker's KV events up to `event_id`."""
    deadline = time.monotonic() + WAIT_S
    async with httpx.AsyncClient(base_url=router.url) as http:
        while True:
            listed = {w["instance_id"]: w["kv_event_id"] for w in (await http.get("/workers")).json()["decode"]}
            if listed.get(worker.instance_id, 0) >= event_id:
                return
            assert time.monotonic() < deadline, f"the router has KV events up to {listed}, not {event_id}"
            await asyncio.sleep(0.05)


async def test_a_gap_in_kv_events_fetches_the_state_and_the_prefix_holder_gets_the_request(router, stand_in, nc):
    holder = await stand_in(num_running=1)
    other = await stand_in()
    await wait_until_router_lists(router, holder, other)
    request = generate_request(num_prompt_tokens=600)
    hashes = prefix_block_hashes(request.prompt_token_ids, tenant=request.tenant, num_public_prefix_tokens=0, block_size=16)
    blocks = [StoredBlock(block_hash=h, parent_hash=p, num_tokens=16) for h, p in zip(hashes, [0, *hashes[:-1]])]
    asked: asyncio.Queue[KvStateRequest] = asyncio.Queue()

    async def on_state_request(msg: Msg) -> None:
        await asked.put(decode(msg.data, KvStateRequest))
        await msg.respond(encode(KvState(worker_id=holder.instance_id, event_id=6, blocks=blocks[:-1])))

    subscription = await nc.subscribe(subjects.kv_state(holder.instance_id), cb=on_state_request)
    await nc.flush()
    try:
        # The router never saw events 1..6: event 7 is a gap, so it asks for the state (as of 6).
        last = KvEvent(worker_id=holder.instance_id, event_id=7, stored=BlocksStored(blocks=blocks[-1:]))
        await nc.publish(subjects.kv_events(holder.instance_id), encode(last))
        await asyncio.wait_for(asked.get(), WAIT_S)
        await wait_until_router_indexed(router, holder, 7)
    finally:
        await subscription.unsubscribe()
    # One more reply running there, yet 592 of its 600 tokens are cached there: it wins.
    reply = await ask_accepted(nc, request)
    assert (await holder.next_assignment()).reply_id == reply.reply_id
    assert other.assignments.empty()


async def final_event_of(events: asyncio.Queue[TokenEvent], reply_id: str) -> TokenEvent:
    event = await asyncio.wait_for(events.get(), WAIT_S)
    while event.reply_id != reply_id:  # another test's leftovers never match a fresh id
        event = await asyncio.wait_for(events.get(), WAIT_S)
    return event


async def test_workers_whose_queues_are_full_refuse_the_reply_overloaded_and_then_the_door_refuses_the_lane(router, stand_in, nc):
    first, second = await stand_in(QUEUE_FULL, retry_after_s=30.0), await stand_in(QUEUE_FULL, retry_after_s=20.0)
    await wait_until_router_lists(router, first, second)
    offered = generate_request(lane=LANE_FREE, reply_id=uuid.uuid4().hex)
    refusal = await ask_refused(nc, offered)  # the heartbeats expect no wait: both are offered it
    assert (refusal.reason, refusal.retry_after_s) == ("overloaded", 20.0)  # the soonest either worker gave
    # Both refused free work: the next free request is refused at the door, with the soonest ETA.
    refusal = await ask_refused(nc, generate_request(lane=LANE_FREE))
    assert refusal.reason == "overloaded"
    assert 10.0 < refusal.retry_after_s <= 20.0
    assert "free" in refusal.message
    # Paid is not refused at the door: it is offered to the workers (which, here, refuse every lane).
    paid = generate_request(lane=LANE_PAID, reply_id=uuid.uuid4().hex)
    assert "free" not in (await ask_refused(nc, paid)).message
    assert (await first.next_assignment()).reply_id == offered.reply_id
    assert paid.reply_id in {(await first.next_assignment()).reply_id, (await second.next_assignment()).reply_id}


async def test_a_fleet_98_percent_busy_climbs_to_rung_3_where_free_is_refused_and_paid_admitted(router, stand_in, nc):
    statuses: asyncio.Queue[LadderStatus] = asyncio.Queue()

    async def on_status(msg: Msg) -> None:
        status = decode(msg.data, LadderStatus)
        if status.router_id == router.instance_id:
            await statuses.put(status)

    subscription = await nc.subscribe(subjects.LADDER, cb=on_status)
    await nc.flush()
    # 98 % of the KV blocks in use, and a free request would wait 1.96 s (98 % of the free target,
    # over this router's start deadline of 1 s).
    worker = await stand_in(kv_blocks_free=20, estimated_wait_s=1.96)
    await wait_until_router_lists(router, worker)
    rungs: list[int] = []
    try:
        while not rungs or rungs[-1] < 3:  # bounded by WAIT_S for each status
            status = await asyncio.wait_for(statuses.get(), WAIT_S)
            rungs.append(status.rung)
    finally:
        await subscription.unsubscribe()
    climbed = [rung for rung in rungs if rung > 0]
    assert climbed == [1, 2, 3]  # one rung per observation
    assert status.busyness > 0.97 and status.kv_occupancy > 0.97
    assert status.interval_s == LADDER_INTERVAL_S
    refusal = await ask_refused(nc, generate_request(lane=LANE_FREE))
    assert refusal.reason == "overloaded"
    assert refusal.retry_after_s >= LADDER_INTERVAL_S
    assert "cannot start within 1 s" in refusal.message
    paid = await ask_accepted(nc, generate_request(lane=LANE_PAID))
    assert (await worker.next_assignment()).reply_id == paid.reply_id
    async with httpx.AsyncClient(base_url=router.url) as http:
        body = (await http.get(f"{router.ops_url}/metrics")).text
    assert "tandem_router_ladder_rung 3.0" in body


async def test_a_small_model_request_goes_to_the_large_pool_while_the_small_one_is_down_then_full(nats_server, redis_server, stand_in, nc):
    small_model = f"{MODEL}-int8"
    router = await start_router(nats_server, redis_server, nc, TANDEM_LARGE_MODEL=MODEL, TANDEM_SMALL_MODEL=small_model)
    events: asyncio.Queue[TokenEvent] = asyncio.Queue()

    async def on_event(msg: Msg) -> None:
        await events.put(decode(msg.data, TokenEvent))

    subscription = await nc.subscribe(subjects.FINALS_ALL, cb=on_event)  # the router's own final events
    await nc.flush()
    try:
        large = await stand_in()
        await wait_until_router_lists(router, large)
        down = await ask_accepted(nc, generate_request(model=small_model, lane=LANE_PAID))  # no small worker at all
        assert down.model == MODEL
        assert (await large.next_assignment()).reply_id == down.reply_id
        small = await stand_in(QUEUE_FULL, retry_after_s=20.0, model=small_model)
        await wait_until_router_lists(router, large, small)
        first = await ask_accepted(nc, generate_request(model=small_model, lane=LANE_FREE))
        assert first.model == small_model, "the small pool takes work: its own model"
        assert (await small.next_assignment()).reply_id == first.reply_id
        moved = await large.next_assignment()  # the only small worker said its queue is full
        assert (moved.reply_id, moved.request.model) == (first.reply_id, MODEL)
        full = await ask_accepted(nc, generate_request(model=small_model, lane=LANE_FREE))
        assert full.model == MODEL, "every small worker refused the lane lately: the large pool takes it"
        assert (await large.next_assignment()).reply_id == full.reply_id
        async with httpx.AsyncClient(base_url=router.url) as http:
            text = (await http.get(f"{router.ops_url}/metrics")).text
        for why, count in (("down", 1), ("full", 2)):  # full: once placing the reply, once at the door
            line = f'tandem_router_model_fallbacks_total{{from_model="{small_model}",to_model="{MODEL}",why="{why}"}} {count:.1f}'
            assert line in text, (why, [line for line in text.splitlines() if "fallbacks" in line])
        assert events.empty(), "no reply ended with an error"
    finally:
        await subscription.unsubscribe()
        router.child.stop(timeout_s=10)
