import pytest

from tandem.bus import BadMessage, decode, encode
from tandem.v1.common_pb2 import LANE_PAID, SamplingParams
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest, Refusal


def test_generate_request_round_trips():
    request = GenerateRequest(
        request_id="q1",
        model="auto",
        lane=LANE_PAID,
        prompt_token_ids=[1, 2, 70000],
        sampling=SamplingParams(temperature=0.0, max_tokens=64, seed=7, stop=["\n\n"]),
    )
    decoded = decode(encode(request), GenerateRequest)
    assert decoded == request
    assert decoded.sampling.HasField("seed")


def test_reply_is_either_accepted_or_refused():
    refused = decode(encode(GenerateReply(refused=Refusal(reason="overloaded", retry_after_s=2))), GenerateReply)
    assert refused.WhichOneof("outcome") == "refused"
    assert decode(encode(GenerateReply(reply_id="r1")), GenerateReply).WhichOneof("outcome") == "reply_id"


def test_garbage_is_a_clear_error():
    with pytest.raises(BadMessage, match="not a valid tandem.v1.GenerateRequest"):
        decode(b"\xff\xff\xff\xff", GenerateRequest)
