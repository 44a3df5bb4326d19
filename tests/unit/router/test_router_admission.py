import math

import pytest
from router_fakes import MODEL, decode_worker, request

from services.router.admission import Admitted, admit, parse_request
from tandem.v1.generate_pb2 import GenerateRequest, Refusal

WORKERS = [decode_worker("d1"), decode_worker("d2", num_running=3)]


def refused(req: GenerateRequest, workers=WORKERS) -> Refusal:
    outcome = admit(req, workers)
    assert isinstance(outcome, Refusal), outcome
    return outcome


def test_a_valid_request_is_admitted_with_the_model_and_its_window():
    assert admit(request(model=MODEL), WORKERS) == Admitted(model=MODEL, window=8192)


@pytest.mark.parametrize("model", ["auto", ""])
def test_auto_picks_the_model_most_workers_serve(model):
    workers = [*WORKERS, decode_worker("big", model="Llama-3-8B")]
    assert admit(request(model=model), workers) == Admitted(model=MODEL, window=8192)


def test_auto_picks_by_name_on_a_tie_so_every_router_agrees():
    workers = [decode_worker("a", model="zeta"), decode_worker("b", model="alpha")]
    assert admit(request(), workers).model == "alpha"
    assert admit(request(), workers[::-1]).model == "alpha"


def test_the_window_is_the_smallest_among_workers_that_take_work():
    workers = [
        decode_worker("d1", max_model_len=4096),
        decode_worker("d2"),
        decode_worker("gone", max_model_len=1024, is_ready=False),
    ]
    assert admit(request(model=MODEL), workers) == Admitted(model=MODEL, window=4096)


def test_a_garbage_payload_is_a_bad_request_with_the_decode_error():
    outcome = parse_request(b"\x0a\xff\x01")
    assert isinstance(outcome, Refusal)
    assert outcome.reason == "bad_request"
    assert "not a valid tandem.v1.GenerateRequest" in outcome.message


def test_a_valid_payload_parses():
    assert parse_request(request().SerializeToString()) == request()


def test_an_empty_prompt_is_refused():
    refusal = refused(request(num_prompt_tokens=0))
    assert refusal.reason == "empty_prompt"
    assert "no prompt tokens" in refusal.message
    assert refusal.retry_after_s == 0


@pytest.mark.parametrize(
    ("max_tokens", "fragment"),
    [(0, "at least 1"), (8193, "max_tokens is 8193 but SmolLM2-135M-Instruct has a window of 8192")],
)
def test_max_tokens_outside_one_to_the_window_is_refused(max_tokens, fragment):
    refusal = refused(request(max_tokens=max_tokens))
    assert refusal.reason == "bad_max_tokens"
    assert fragment in refusal.message


def test_max_tokens_equal_to_the_window_is_admitted():
    assert isinstance(admit(request(max_tokens=8192), WORKERS), Admitted)


def test_an_unknown_model_is_refused_naming_the_models_served():
    workers = [*WORKERS, decode_worker("big", model="Llama-3-8B")]
    refusal = refused(request(model="gpt-9"), workers)
    assert refusal.reason == "unknown_model"
    assert "'gpt-9'" in refusal.message
    assert "models served: Llama-3-8B, SmolLM2-135M-Instruct" in refusal.message
    assert refusal.retry_after_s == 0


def test_a_prompt_one_token_short_of_the_window_is_admitted():
    assert isinstance(admit(request(num_prompt_tokens=8191), WORKERS), Admitted)


def test_a_prompt_that_leaves_no_room_for_an_answer_is_refused_with_the_counts():
    refusal = refused(request(num_prompt_tokens=8192))
    assert refusal.reason == "prompt_too_long"
    assert "the prompt has 8192 tokens" in refusal.message
    assert "at most 8191" in refusal.message
    assert "window is 8192 tokens" in refusal.message
    assert refusal.retry_after_s == 0


def test_a_continuation_counts_the_tokens_already_generated():
    refusal = refused(request(num_prompt_tokens=8000, resume_reply_id="r1", generated_token_ids=[5] * 192))
    assert refusal.reason == "prompt_too_long"
    assert "already generated have 8192 tokens" in refusal.message


def test_no_live_worker_is_refused_with_a_retry():
    refusal = refused(request(), [])
    assert refusal.reason == "no_workers"
    assert refusal.retry_after_s == 2


@pytest.mark.parametrize(
    "worker",
    [decode_worker("d", is_ready=False), decode_worker("d", is_engine_ready=False), decode_worker("d", max_model_len=0)],
)
def test_workers_that_do_not_take_work_yet_mean_no_workers_not_an_unknown_model(worker):
    for model in (MODEL, "auto"):
        refusal = refused(request(model=model), [worker])
        assert refusal.reason == "no_workers"
        assert refusal.message == f"no decode worker for {MODEL} takes work now (1 starting, loading or draining)"
        assert refusal.retry_after_s == 2


def test_a_public_prefix_longer_than_the_prompt_is_a_bad_request():
    refusal = refused(request(num_prompt_tokens=4, public_prefix_tokens=5))
    assert refusal.reason == "bad_request"
    assert "public_prefix_tokens is 5 but the prompt has 4 tokens" in refusal.message


def test_a_resume_reply_id_that_is_no_subject_token_is_a_bad_request():
    refusal = refused(request(resume_reply_id="r1.>"))
    assert refusal.reason == "bad_request"
    assert "resume_reply_id" in refusal.message


@pytest.mark.parametrize(("field", "value"), [("temperature", -0.5), ("temperature", math.nan), ("top_p", 1.5), ("top_p", -0.1)])
def test_sampling_out_of_range_is_refused(field, value):
    req = request()
    setattr(req.sampling, field, value)
    refusal = refused(req)
    assert refusal.reason == "bad_sampling"
    assert f"sampling.{field}" in refusal.message


def test_a_caller_chosen_reply_id_that_is_no_subject_token_is_a_bad_request():
    refusal = refused(request(reply_id="a b"))
    assert refusal.reason == "bad_request"
    assert "reply_id" in refusal.message


def test_a_continuation_cannot_change_its_reply_id():
    refusal = refused(request(reply_id="r2", resume_reply_id="r1", generated_token_ids=[5]))
    assert refusal.reason == "bad_request"
