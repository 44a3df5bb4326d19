import re

from router_fakes import MODEL, decode_worker, request

from services.router.dispatch import DispatchConfig
from services.router.generate import GenerateService, new_reply_id
from services.router.placement import Placement
from services.router.workers import WorkerRegistry
from tandem.bus import subjects
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply


async def never_called(*args: object) -> None:
    raise AssertionError("the handler must not reach the network")


def service(*workers) -> tuple[GenerateService, WorkerRegistry]:
    registry = WorkerRegistry()
    for worker in workers:
        registry.observe(worker.heartbeat)
    return GenerateService(registry, Placement(), never_called, never_called, DispatchConfig()), registry


def test_reply_ids_are_unique_nats_subject_tokens():
    ids = {new_reply_id() for _ in range(1000)}
    assert len(ids) == 1000
    for reply_id in ids:
        assert re.fullmatch(r"[A-Za-z0-9_-]+", reply_id)
        assert subjects.tokens(reply_id).endswith(reply_id)


def test_an_admitted_request_gets_a_reply_id_and_a_job_for_the_least_loaded_worker_first():
    generate, _ = service(decode_worker("busy", num_running=4), decode_worker("idle"))
    req = request(conversation_id="c1")
    reply, job = generate.handle(req.SerializeToString())
    assert reply.WhichOneof("outcome") == "reply_id"
    assert reply.model == MODEL
    req.model = MODEL  # "auto" goes to the workers as the served id that answers it
    assert job.assignment == Assignment(reply_id=reply.reply_id, request=req, first_seq=1)
    assert job.worker_ids == ("idle", "busy")


def test_a_burst_spreads_before_any_heartbeat_reports_it():
    generate, _ = service(decode_worker("d1"), decode_worker("d2"))
    firsts = [generate.handle(request(conversation_id=f"c{i}").SerializeToString())[1].worker_ids[0] for i in range(10)]
    assert firsts.count("d1") == firsts.count("d2") == 5


def test_a_fresh_heartbeat_replaces_the_routers_own_tally():
    generate, registry = service(decode_worker("d1"))
    generate.handle(request().SerializeToString())
    assert registry.workers("decode")[0].num_assigned == 1
    registry.observe(decode_worker("d1", num_waiting=1).heartbeat)
    assert registry.workers("decode")[0].num_assigned == 0


def test_a_continuation_keeps_its_reply_id_and_numbering():
    generate, _ = service(decode_worker("d1"))
    reply, job = generate.handle(request(resume_reply_id="r-old", generated_token_ids=[7, 8, 9]).SerializeToString())
    assert reply.reply_id == "r-old"
    assert job.assignment.first_seq == 4


def test_garbage_and_invalid_requests_are_refused_without_a_job():
    generate, _ = service(decode_worker("d1"))
    reply, job = generate.handle(b"\x0a\xff\x01")
    assert (reply.refused.reason, job) == ("bad_request", None)
    reply, job = generate.handle(request(num_prompt_tokens=0).SerializeToString())
    assert (reply.refused.reason, job) == ("empty_prompt", None)


async def test_a_job_is_offered_in_rank_order_and_a_refused_worker_is_counted_once_retried():
    offers: list[str] = []

    async def assign(worker_id: str, assignment: Assignment) -> AssignmentReply:
        offers.append(worker_id)
        return AssignmentReply(accepted=True) if worker_id == "d2" else AssignmentReply(refused={"reason": "draining"})

    registry = WorkerRegistry()
    registry.observe(decode_worker("d1").heartbeat)
    registry.observe(decode_worker("d2", num_running=1).heartbeat)
    generate = GenerateService(registry, Placement(), assign, never_called, DispatchConfig())
    _, job = generate.handle(request(num_prompt_tokens=512).SerializeToString())
    await generate.dispatch(job)
    assert offers == ["d1", "d2"]
    assert {w.instance_id: w.num_assigned for w in registry.workers("decode")} == {"d1": 1, "d2": 1}


def test_a_caller_chosen_reply_id_is_kept():
    generate, _ = service(decode_worker("d1"))
    reply, job = generate.handle(request(reply_id="msg-42").SerializeToString())
    assert reply.reply_id == job.assignment.reply_id == "msg-42"
