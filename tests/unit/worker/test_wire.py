"""The worker's events on the wire: the final one names the served model that wrote the reply."""

from __future__ import annotations

from dataclasses import replace

from tandem.bus.events import is_final
from tandem.engine.engine import RequestOutput, TokenLogprobs
from tandem.engine.sequence import FinishReason, StopReason
from tandem.v1.common_pb2 import FINISH_REASON_LENGTH, FINISH_REASON_STOP, SamplingParams
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.worker.wire import engine_request, token_event


def output(finish: FinishReason | None) -> RequestOutput:
    return RequestOutput("r1", (7,), "hi", finish, num_prompt_tokens=5, num_cached_tokens=2, num_output_tokens=3)


def test_the_final_event_names_the_served_model_with_its_usage():
    event = token_event(output(FinishReason.STOP), seq=3, worker_id="decode-0", epoch=1, model="SmolLM2-135M-Instruct-int8")
    assert is_final(event) and event.finish == FINISH_REASON_STOP
    assert event.model == "SmolLM2-135M-Instruct-int8"
    assert (event.usage.input_tokens, event.usage.cached_tokens, event.usage.output_tokens) == (5, 2, 3)
    assert (event.seq, event.epoch, event.worker_id, event.text, event.token_id) == (3, 1, "decode-0", "hi", 7)


def test_a_reply_the_repetition_stop_ended_says_so_on_its_final_event_only():
    repeating = replace(output(FinishReason.LENGTH), stop_reason=StopReason.REPETITION)
    event = token_event(repeating, seq=3, worker_id="decode-0", epoch=0)
    assert (event.finish, event.stop_reason) == (FINISH_REASON_LENGTH, "repetition")
    assert token_event(output(FinishReason.LENGTH), seq=3, worker_id="decode-0", epoch=0).stop_reason == ""


def test_a_token_event_before_the_end_carries_no_model():
    event = token_event(output(None), seq=2, worker_id="decode-0", epoch=0, model="SmolLM2-135M-Instruct")
    assert not is_final(event)
    assert event.model == ""
    assert (event.text, event.token_id) == ("hi", 7)


def test_a_generate_request_carries_every_sampling_parameter_to_the_engine():
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, seed=3, max_tokens=9, stop=["x"], stop_token_ids=[4])
    params.ignore_eos, params.min_tokens = True, 2
    params.presence_penalty, params.frequency_penalty, params.repetition_penalty = 0.5, -1.0, 1.5
    params.logit_bias[9] = -100.0
    params.logit_bias[3] = 2.5
    sampling = engine_request("r1", GenerateRequest(prompt_token_ids=[1, 2], sampling=params)).sampling
    assert (sampling.top_k, sampling.seed, sampling.max_tokens, sampling.stop, sampling.stop_token_ids) == (7, 3, 9, ("x",), (4,))
    assert (sampling.ignore_eos, sampling.min_tokens) == (True, 2)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.0, 1.5)
    assert sampling.logit_bias == ((3, 2.5), (9, -100.0))


def test_an_unset_repetition_penalty_on_the_wire_is_off():
    sampling = engine_request("r1", GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=4))).sampling
    assert sampling.repetition_penalty == 1.0 and not sampling.has_penalties and sampling.logit_bias == ()


def test_top_logprobs_reach_the_engine_only_when_set_and_zero_is_not_unset():
    assert engine_request("r1", GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(max_tokens=4))).sampling.top_logprobs is None
    params = SamplingParams(max_tokens=4, top_logprobs=0)
    assert engine_request("r1", GenerateRequest(prompt_token_ids=[1], sampling=params)).sampling.top_logprobs == 0


def test_token_events_carry_the_tokens_logprobs_when_the_engine_computed_them():
    logprobs = TokenLogprobs(-0.25, ((7, -0.25), (9, -2.0)))
    for finish in (None, FinishReason.LENGTH):
        event = token_event(replace(output(finish), logprobs=logprobs), seq=2, worker_id="decode-0", epoch=0)
        assert event.HasField("logprob") and event.logprob == -0.25
        assert [(t.token_id, t.logprob) for t in event.top_logprobs] == [(7, -0.25), (9, -2.0)]
        read = TokenEvent.FromString(event.SerializeToString())  # as the token log stores it
        assert read.logprob == -0.25 and len(read.top_logprobs) == 2
    plain = token_event(output(None), seq=2, worker_id="decode-0", epoch=0)
    assert not plain.HasField("logprob") and not plain.top_logprobs
