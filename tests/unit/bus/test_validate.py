"""Bus messages are checked before use: ids match their subjects, sizes and numbers are bounded,
addresses are sane host:port pairs, enums are known; a bad one is Invalid with a reason, and
dropping it counts it and logs it once per sender subject."""

import logging
import math

import pytest

from tandem.bus import encode, subjects, validate
from tandem.bus.validate import Invalid
from tandem.v1.common_pb2 import FINISH_REASON_ERROR, FINISH_REASON_LENGTH, Error, SamplingParams
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply, HandoffOutcome
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest, Refusal
from tandem.v1.kv_pb2 import BlocksStored, KvEvent, KvState, StoredBlock
from tandem.v1.tokens_pb2 import Cancel, TokenBatch, TokenEvent, TokenLogprob
from tandem.v1.worker_pb2 import LadderStatus, ModelRollout, ReplyOutcome, RolloutStatus, ServiceHeartbeat, VersionWindow, WorkerHeartbeat


def heartbeat(**fields) -> WorkerHeartbeat:
    service = ServiceHeartbeat(role="decode", instance_id="decode-1", interval_s=1.0, is_ready=True)
    beat = WorkerHeartbeat(
        service=service, model="m", grpc_address="127.0.0.1:50051", ucx_address="worker-1.local:13337", kv_blocks_total=10
    )
    for name, value in fields.items():
        if name in ("role", "instance_id", "interval_s"):
            setattr(beat.service, name, value)
        elif name == "reply_ids":
            beat.reply_ids.extend(value)
        else:
            setattr(beat, name, value)
    return beat


def reason_of(parse, *args) -> str:
    with pytest.raises(Invalid) as refused:
        parse(*args)
    return refused.value.reason


def test_a_sound_heartbeat_passes_as_is():
    beat = heartbeat(reply_ids=["r-1", "r_2"])
    assert validate.worker_heartbeat(encode(beat), subjects.heartbeat("decode", "decode-1")) == beat


@pytest.mark.parametrize(
    ("fields", "subject", "reason"),
    [
        ({}, subjects.heartbeat("decode", "decode-2"), "id_mismatch"),  # another worker's subject
        ({}, subjects.heartbeat("prefill", "decode-1"), "id_mismatch"),  # another role's
        ({"role": "router"}, "tandem.v1.heartbeat.router.decode-1", "id_mismatch"),  # not a worker role
        ({"grpc_address": "10.0.0.1:0"}, None, "bad_address"),
        ({"grpc_address": "10.0.0.1:65536"}, None, "bad_address"),
        ({"ucx_address": "no-port"}, None, "bad_address"),
        ({"ucx_address": "bad host:1"}, None, "bad_address"),
        ({"ucx_address": "[not-v6]:1"}, None, "bad_address"),
        ({"kv_blocks_free": 11}, None, "out_of_range"),
        ({"estimated_wait_s": math.nan}, None, "out_of_range"),
        ({"step_time_ms": -1.0}, None, "out_of_range"),
        ({"interval_s": math.inf}, None, "out_of_range"),
        ({"model": "m" * 300}, None, "too_large"),
        ({"reply_ids": ["ok", "tandem.v1.>"]}, None, "bad_id"),
    ],
)
def test_a_bad_heartbeat_is_invalid(fields, subject, reason):
    assert reason_of(validate.worker_heartbeat, encode(heartbeat(**fields)), subject or subjects.heartbeat("decode", "decode-1")) == reason


def test_ipv6_and_host_names_are_sane_addresses():
    for address in ("[::1]:9000", "localhost:1", "decode-0.tandem.svc.cluster.local:50051"):
        validate.check_address(address, "address")


def test_garbage_and_oversized_payloads_are_invalid():
    assert reason_of(validate.generate_request, b"\x0a\xff\x01") == "undecodable"
    assert reason_of(validate.generate_request, b"\x00" * (validate.MAX_MESSAGE_BYTES + 1)) == "too_large"


def request(**fields) -> GenerateRequest:
    return GenerateRequest(**{"reply_id": "r1", "prompt_token_ids": [1, 2, 3], "sampling": SamplingParams(max_tokens=8), **fields})


def test_a_generate_request_is_bounded_but_admission_keeps_its_own_refusals():
    # An empty prompt or max_tokens of 0 is admission's to refuse, with its own reasons.
    validate.generate_request(encode(GenerateRequest(reply_id="r1")))
    assert reason_of(validate.generate_request, encode(request(reply_id="a.b"))) == "bad_id"
    assert reason_of(validate.generate_request, encode(request(lane=9))) == "unknown_enum"
    too_many_stops = request()
    too_many_stops.sampling.stop.extend(["x"] * (validate.MAX_STOP_STRINGS + 1))
    assert reason_of(validate.generate_request, encode(too_many_stops)) == "too_large"
    nan_temperature = request()
    nan_temperature.sampling.temperature = math.nan
    assert reason_of(validate.generate_request, encode(nan_temperature)) == "out_of_range"


def test_token_ids_must_be_in_the_vocabulary_where_it_is_known():
    data = encode(request())
    assert validate.generate_request(data, vocab_size=4).prompt_token_ids == [1, 2, 3]
    assert reason_of(validate.generate_request, data, 3) == "out_of_range"
    assert reason_of(validate.generate_request, encode(GenerateRequest(prompt_token_ids=[validate.MAX_VOCAB_SIZE]))) == "out_of_range"


def test_an_assignment_names_a_sane_decode_worker():
    sound = Assignment(reply_id="r1", request=request(), decode_worker_id="d-1", decode_grpc_address="10.1.2.3:50051")
    assert validate.assignment(encode(sound)) == sound
    for bad in (
        Assignment(reply_id="r1", request=request(), decode_grpc_address="evil host:1"),
        Assignment(reply_id="", request=request()),
        Assignment(reply_id="r1", request=request(), decode_worker_id="d.*"),
    ):
        with pytest.raises(Invalid):
            validate.assignment(encode(bad))


def token_event(**fields) -> TokenEvent:
    return TokenEvent(**{"reply_id": "r1", "seq": 1, "text": "hi", **fields})


def test_a_token_event_belongs_to_its_subject_and_its_error_is_a_code_and_a_short_message():
    subject = subjects.tokens("r1")
    assert validate.token_event(encode(token_event()), subject).text == "hi"
    assert reason_of(validate.token_event, encode(token_event()), subjects.tokens("r2")) == "id_mismatch"
    assert reason_of(validate.token_event, encode(TokenEvent(reply_id="r1", seq=0)), subject) == "out_of_range"
    assert reason_of(validate.token_event, encode(token_event(finish=42)), subject) == "unknown_enum"
    assert reason_of(validate.token_event, encode(token_event(token_id=9)), subject, 9) == "out_of_range"
    assert reason_of(validate.token_event, encode(token_event(text="x" * (validate.MAX_TEXT_CHARS + 1))), subject) == "too_large"
    bad_code = token_event(finish=FINISH_REASON_ERROR, error=Error(code="no such code!", message="m"))
    assert reason_of(validate.token_event, encode(bad_code), subject) == "bad_code"
    long_message = token_event(finish=FINISH_REASON_ERROR, error=Error(code="failed", message="m" * 2000))
    assert reason_of(validate.token_event, encode(long_message), subject) == "too_large"
    repeating = token_event(finish=FINISH_REASON_LENGTH, stop_reason="repetition")
    assert validate.token_event(encode(repeating), subject).stop_reason == "repetition"
    assert reason_of(validate.token_event, encode(token_event(finish=FINISH_REASON_LENGTH, stop_reason="<b>x</b>")), subject) == "bad_code"


def test_a_token_batch_belongs_to_its_workers_subject_and_drops_only_its_bad_events():
    subject = subjects.token_batch("w1")
    good = [token_event(reply_id="r1", seq=1, worker_id="w1"), token_event(reply_id="r2", seq=7, worker_id="w1")]
    bad = [
        token_event(reply_id="r3", seq=0, worker_id="w1"),
        token_event(reply_id="r4", worker_id="w2"),
        token_event(reply_id="a.b", worker_id="w1"),
    ]
    events, invalid = validate.token_batch(encode(TokenBatch(worker_id="w1", events=[good[0], *bad, good[1]])), subject)
    assert [(e.reply_id, e.seq) for e in events] == [("r1", 1), ("r2", 7)]
    assert [exc.reason for exc in invalid] == ["out_of_range", "id_mismatch", "bad_id"]
    assert reason_of(validate.token_batch, encode(TokenBatch(worker_id="w2", events=good)), subject) == "id_mismatch"
    assert reason_of(validate.token_batch, b"\xff\xff", subject) == "undecodable"
    too_many = TokenBatch(worker_id="w1", events=[good[0]] * (validate.MAX_BATCH_EVENTS + 1))
    assert reason_of(validate.token_batch, encode(too_many), subject) == "too_large"


def test_a_token_events_logprobs_are_at_most_zero_and_name_at_most_twenty_tokens_of_the_vocabulary():
    subject = subjects.tokens("r1")
    sound = token_event(
        token_id=3, logprob=-0.5, top_logprobs=[TokenLogprob(token_id=3, logprob=-0.5), TokenLogprob(token_id=4, logprob=-math.inf)]
    )
    assert validate.token_event(encode(sound), subject, 9).top_logprobs[1].token_id == 4
    assert reason_of(validate.token_event, encode(token_event(logprob=0.5)), subject) == "out_of_range"
    assert reason_of(validate.token_event, encode(token_event(logprob=math.nan)), subject) == "out_of_range"
    assert reason_of(validate.token_event, encode(token_event(top_logprobs=[TokenLogprob(token_id=9)])), subject, 9) == "out_of_range"
    too_many = token_event(top_logprobs=[TokenLogprob(token_id=1, logprob=-1.0)] * (validate.MAX_TOP_LOGPROBS + 1))
    assert reason_of(validate.token_event, encode(too_many), subject) == "too_large"
    asks = GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=4, top_logprobs=validate.MAX_TOP_LOGPROBS + 1))
    assert reason_of(validate.generate_request, encode(asks)) == "too_large"


def test_a_finals_subject_carries_only_a_final_event_so_the_router_and_relays_never_send_tokens():
    failed = token_event(text="", finish=FINISH_REASON_ERROR, error=Error(code="overloaded", message="busy"))
    assert validate.token_event(encode(failed), subjects.final("r1")).error.code == "overloaded"
    assert reason_of(validate.token_event, encode(token_event()), subjects.final("r1")) == "not_final"
    assert reason_of(validate.token_event, encode(failed), subjects.final("r2")) == "id_mismatch"


def test_kv_events_and_states_belong_to_their_worker():
    stored = KvEvent(event_id=1, stored=BlocksStored(blocks=[StoredBlock(block_hash=1, num_tokens=16)]))
    assert validate.kv_event(encode(stored), subjects.kv_events("w1")).worker_id == "w1"  # the subject's, when unsaid
    stored.worker_id = "w2"
    assert reason_of(validate.kv_event, encode(stored), subjects.kv_events("w1")) == "id_mismatch"
    assert reason_of(validate.kv_event, encode(KvEvent(worker_id="w1")), subjects.kv_events("w1")) == "unknown_enum"
    assert reason_of(validate.kv_state, encode(KvState(worker_id="w2")), "w1") == "id_mismatch"


def test_replies_refusals_cancels_outcomes_and_ladder_statuses_are_checked():
    assert validate.generate_reply(encode(GenerateReply(reply_id="r1"))).reply_id == "r1"
    assert reason_of(validate.generate_reply, encode(GenerateReply(model="m"))) == "unknown_enum"
    long_refusal = GenerateReply(refused=Refusal(reason="overloaded", message="x" * 5000))
    assert reason_of(validate.generate_reply, encode(long_refusal)) == "too_large"
    assert reason_of(validate.assignment_reply, encode(AssignmentReply(refused=Refusal(reason="a b")))) == "bad_code"
    assert validate.cancel(encode(Cancel(reason="user")), subjects.cancel("r1")).reply_id == "r1"
    assert reason_of(validate.cancel, encode(Cancel(reply_id="r2")), subjects.cancel("r1")) == "id_mismatch"
    assert reason_of(validate.handoff_outcome, encode(HandoffOutcome(reply_id="r1", result=7)), subjects.handoff("r1")) == "unknown_enum"
    assert validate.ladder_status(encode(LadderStatus(router_id="router-1", rung=2, busyness=0.9))).rung == 2
    assert reason_of(validate.ladder_status, encode(LadderStatus(router_id="router-1", busyness=1.5))) == "out_of_range"


def test_a_dropped_message_is_counted_each_time_and_logged_once_per_sender(caplog):
    subject = subjects.heartbeat("decode", "decode-flood")
    error = Invalid("bad_address", "grpc_address 'x' has no port")
    before = validate.DROPPED.labels(kind="heartbeat", reason="bad_address")._value.get()
    with caplog.at_level(logging.WARNING, logger="tandem.bus.validate"):
        for _ in range(3):
            validate.drop("heartbeat", subject, error)
    assert validate.DROPPED.labels(kind="heartbeat", reason="bad_address")._value.get() == before + 3
    assert [r.getMessage() for r in caplog.records if subject in r.getMessage()] == [
        f"dropped a heartbeat on {subject} (bad_address): grpc_address 'x' has no port; more like it are counted, not logged"
    ]


def test_rollout_statuses_and_reply_outcomes_are_checked():
    good = RolloutStatus(
        router_id="router-1", interval_s=2.0, models=[ModelRollout(model="smol", stable="1", candidate="2", candidate_percent=10)]
    )
    assert validate.rollout_status(encode(good)).models[0].candidate == "2"
    for change, reason in (
        (lambda s: setattr(s.models[0], "candidate_percent", 101.0), "out_of_range"),
        (lambda s: setattr(s.models[0], "model", "smol@1"), "bad_id"),
        (lambda s: setattr(s.models[0], "stable", "no spaces"), "bad_id"),
        (lambda s: s.models[0].candidate_window.CopyFrom(VersionWindow(replies=1, errors=2)), "out_of_range"),
        (lambda s: setattr(s, "router_id", "a.b"), "bad_id"),
    ):
        bad = RolloutStatus()
        bad.CopyFrom(good)
        change(bad)
        assert reason_of(validate.rollout_status, encode(bad)) == reason
    outcome = ReplyOutcome(reply_id="r1", model="smol@2", ttft_s=0.3, is_error=True)
    assert validate.reply_outcome(encode(outcome)).model == "smol@2"
    assert reason_of(validate.reply_outcome, encode(ReplyOutcome(reply_id="r1", model="smol@2", ttft_s=-1))) == "out_of_range"
    assert reason_of(validate.reply_outcome, encode(ReplyOutcome(reply_id="r1", model="@2"))) == "bad_id"
    assert reason_of(validate.reply_outcome, encode(ReplyOutcome(model="smol"))) == "bad_id"
    assert reason_of(validate.generate_request, encode(GenerateRequest(model="smol@2", shadow_of="r 1"))) == "bad_id"
