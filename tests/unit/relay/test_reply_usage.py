"""What a finished reply adds to the usage ledger: the usage its final event reported (the one its
client was shown), under the served model and the UTC day its log closed; an end without usage
counts its prompt and the tokens it delivered; background work and bus clients are not billed."""

from __future__ import annotations

from datetime import date

from services.relay.ledger import reply_usage
from tandem.bus.events import ReplyStatus
from tandem.store import ReplyUsage
from tandem.tokenlog import ReplyMeta
from tandem.v1.common_pb2 import FINISH_REASON_ERROR, FINISH_REASON_STOP, LANE_BACKGROUND, LANE_PAID, Usage
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent

CLOSED_MS = 1_741_996_799_000  # 2025-03-14T23:59:59Z


def meta(lane: int = LANE_PAID, user_id: str = "alice", num_prompt: int = 12) -> ReplyMeta:
    request = GenerateRequest(reply_id="r1", lane=lane, prompt_token_ids=list(range(num_prompt)))
    return ReplyMeta(
        reply_id="r1",
        user_id=user_id,
        model="auto",
        status=ReplyStatus.COMPLETE,
        finished_ms=CLOSED_MS,
        request=request.SerializeToString(),
    )


def test_a_reply_counts_the_usage_its_final_event_reported_under_the_served_model():
    final = TokenEvent(
        reply_id="r1", seq=6, finish=FINISH_REASON_STOP, model="smollm2@2", usage=Usage(input_tokens=12, cached_tokens=8, output_tokens=5)
    )
    assert reply_usage(meta(), final) == ReplyUsage("r1", "alice", "smollm2@2", date(2025, 3, 14), 12, 8, 5)


def test_an_end_without_usage_counts_its_prompt_and_the_tokens_delivered_under_the_model_asked_of():
    final = TokenEvent(reply_id="r1", seq=4, finish=FINISH_REASON_ERROR)  # three tokens delivered before it
    assert reply_usage(meta(num_prompt=30), final) == ReplyUsage("r1", "alice", "auto", date(2025, 3, 14), 30, 0, 3)


def test_background_work_and_a_reply_without_a_user_are_not_billed():
    final = TokenEvent(reply_id="r1", seq=3, finish=FINISH_REASON_STOP, usage=Usage(input_tokens=12, output_tokens=2))
    assert reply_usage(meta(lane=LANE_BACKGROUND), final) is None
    assert reply_usage(meta(user_id=""), final) is None


def test_a_shadow_reply_is_not_billed_even_outside_the_background_lane():
    final = TokenEvent(reply_id="r1", seq=3, finish=FINISH_REASON_STOP, usage=Usage(input_tokens=12, output_tokens=2))
    shadow = meta()
    request = GenerateRequest.FromString(shadow.request)
    request.shadow_of = "r0"
    assert reply_usage(ReplyMeta(**{**shadow.__dict__, "request": request.SerializeToString()}), final) is None
