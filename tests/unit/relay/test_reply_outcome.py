"""A finished reply's outcome, as the routers' rollbacks read it: the served model its final event
names (else the one its meta recorded), its time to first token from its creation to its first
logged event, an error only when its final event is one, and whether it was a shadow; publishing
never raises for the bus, and counts what it lost."""

from __future__ import annotations

import pytest
from nats.errors import ConnectionClosedError

from services.relay import metrics
from services.relay.outcomes import OutcomePublisher, reply_outcome, ttft_s
from tandem.bus import decode, subjects
from tandem.bus.events import ReplyStatus
from tandem.tokenlog import ReplyMeta
from tandem.v1.common_pb2 import FINISH_REASON_CANCELLED, FINISH_REASON_ERROR, FINISH_REASON_STOP
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.v1.worker_pb2 import ReplyOutcome

CREATED_MS = 1_741_996_700_000


def meta(model: str = "smollm2@1", status: ReplyStatus = ReplyStatus.COMPLETE) -> ReplyMeta:
    return ReplyMeta(reply_id="r1", model=model, status=status, created_ms=CREATED_MS, finished_ms=CREATED_MS + 5_000)


def token(seq: int, after_ms: int, **fields: object) -> TokenEvent:
    return TokenEvent(reply_id="r1", seq=seq, text=f"t{seq}", produced_unix_ms=CREATED_MS + after_ms, **fields)  # type: ignore[arg-type]


def test_a_reply_is_told_by_its_served_model_its_first_token_time_and_its_finish():
    first, final = token(1, 250), token(9, 4_000, finish=FINISH_REASON_STOP, model="smollm2@2")
    assert reply_outcome(meta(), shadow_of="", first=first, final=final) == ReplyOutcome(
        reply_id="r1", model="smollm2@2", ttft_s=0.25, is_error=False, is_shadow=False, finished_unix_ms=CREATED_MS + 5_000
    )


def test_an_errored_shadow_reply_is_an_error_of_the_model_its_meta_names_when_its_final_names_none():
    final = TokenEvent(reply_id="r1", seq=3, finish=FINISH_REASON_ERROR, produced_unix_ms=CREATED_MS + 9_000)  # the relay's end
    outcome = reply_outcome(meta(model="smollm2@2", status=ReplyStatus.FAILED), shadow_of="r0", first=token(1, 100), final=final)
    assert (outcome.model, outcome.is_error, outcome.is_shadow, outcome.ttft_s) == ("smollm2@2", True, True, 0.1)


def test_a_cancelled_reply_is_not_an_error():
    final = token(2, 300, finish=FINISH_REASON_CANCELLED)
    assert reply_outcome(meta(status=ReplyStatus.STOPPED), shadow_of="", first=token(1, 100), final=final).is_error is False


def test_no_first_token_time_for_a_reply_that_ended_in_an_error_before_any_token_or_without_clocks():
    error_first = TokenEvent(reply_id="r1", seq=1, finish=FINISH_REASON_ERROR, produced_unix_ms=CREATED_MS + 30_000)
    assert ttft_s(meta(), error_first) == 0.0
    assert ttft_s(meta(), None) == 0.0
    assert ttft_s(meta(), TokenEvent(reply_id="r1", seq=1, text="a")) == 0.0  # no production time
    assert ttft_s(meta(), token(1, -50)) == 0.0  # a clock behind the creator's: never negative
    assert ttft_s(meta(), token(1, 1_500, finish=FINISH_REASON_STOP)) == 1.5  # a one-token reply's token is its final


async def test_an_outcome_goes_out_on_the_outcomes_subject_and_a_failed_publish_is_counted_not_raised():
    sent: list[tuple[str, bytes]] = []

    async def publish(subject: str, data: bytes) -> None:
        sent.append((subject, data))

    async def closed(subject: str, data: bytes) -> None:
        raise ConnectionClosedError

    outcome = ReplyOutcome(reply_id="r1", model="smollm2@1", ttft_s=0.2)
    await OutcomePublisher(publish).publish(outcome)
    assert [(subject, decode(data, ReplyOutcome)) for subject, data in sent] == [(subjects.OUTCOMES, outcome)]
    failed = metrics.OUTCOMES.labels(result="failed")
    before = failed._value.get()
    await OutcomePublisher(closed).publish(outcome)
    assert failed._value.get() == pytest.approx(before + 1)
