from router_fakes import request

from services.router.dispatch import AssignFailed, DispatchConfig, dispatch, failure_event
from tandem.v1.common_pb2 import FINISH_REASON_ERROR
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply
from tandem.v1.generate_pb2 import Refusal

CONFIG = DispatchConfig(assign_timeout_s=2.0, max_attempts=3, retry_after_s=2.0)


class Workers:
    """An in-process Assign: each worker accepts, refuses, or fails as told, and records offers."""

    def __init__(self, **behaviour: object) -> None:
        self.behaviour = behaviour
        self.offers: list[tuple[str, Assignment]] = []

    async def __call__(self, worker_id: str, assignment: Assignment) -> AssignmentReply:
        self.offers.append((worker_id, assignment))
        outcome = self.behaviour[worker_id]
        if isinstance(outcome, AssignFailed):
            raise outcome
        if isinstance(outcome, Refusal):
            return AssignmentReply(refused=outcome)
        return AssignmentReply(accepted=True)

    @property
    def offered_to(self) -> list[str]:
        return [worker_id for worker_id, _ in self.offers]


def assignment() -> Assignment:
    return Assignment(reply_id="r1", request=request(), first_seq=1)


async def test_the_first_worker_that_accepts_takes_it_and_no_one_after():
    workers = Workers(d1="accept", d2="accept")
    result = await dispatch(workers, assignment(), ["d1", "d2"], CONFIG)
    assert result.accepted_by == "d1"
    assert workers.offered_to == ["d1"]
    assert workers.offers[0][1] == assignment()


async def test_a_refusal_or_a_silent_worker_moves_on_to_the_next():
    retried: list[str] = []
    workers = Workers(d1=Refusal(reason="draining"), d2=AssignFailed("timeout", "no answer within 2 s"), d3="accept")
    result = await dispatch(workers, assignment(), ["d1", "d2", "d3"], CONFIG, on_retry=retried.append)
    assert result.accepted_by == "d3"
    assert workers.offered_to == ["d1", "d2", "d3"]
    assert retried == ["d2", "d3"]


async def test_at_most_three_workers_are_tried():
    workers = Workers(**{f"d{i}": Refusal(reason="overloaded", retry_after_s=1.0) for i in range(5)})
    result = await dispatch(workers, assignment(), [f"d{i}" for i in range(5)], CONFIG)
    assert result.accepted_by is None
    assert workers.offered_to == ["d0", "d1", "d2"]


async def test_when_all_refuse_alike_the_error_carries_their_reason_and_the_log_who_was_tried():
    workers = Workers(
        d1=Refusal(reason="overloaded", message="KV full", retry_after_s=3.0),
        d2=Refusal(reason="overloaded", message="queue full", retry_after_s=1.0),
    )
    result = await dispatch(workers, assignment(), ["d1", "d2"], CONFIG)
    event = failure_event(assignment(), result, CONFIG)
    assert (event.reply_id, event.seq, event.finish) == ("r1", 1, FINISH_REASON_ERROR)
    assert event.error.code == "overloaded"
    assert "d1 refused (overloaded: KV full)" in result.describe()
    assert "d2 refused (overloaded: queue full)" in result.describe()
    assert "d1" not in event.error.message and "KV full" not in event.error.message, "workers are not the client's business"
    assert event.error.retry_after_s == 3.0


async def test_mixed_failures_give_a_generic_code_and_the_default_retry():
    workers = Workers(
        d1=Refusal(reason="prompt_too_long", message="KV pool holds 4096 tokens"),
        d2=AssignFailed("no_responders", "nothing listens on its assign subject"),
    )
    result = await dispatch(workers, assignment(), ["d1", "d2"], CONFIG)
    error = failure_event(assignment(), result, CONFIG).error
    assert error.code == "no_worker_accepted"
    assert "d2: nothing listens on its assign subject" in result.describe()
    assert "d2" not in error.message
    assert error.retry_after_s == 2.0


async def test_a_refusal_not_worth_retrying_leaves_retry_after_unset():
    workers = Workers(d1=Refusal(reason="prompt_too_long", message="KV pool holds 4096 tokens"))
    error = failure_event(assignment(), await dispatch(workers, assignment(), ["d1"], CONFIG), CONFIG).error
    assert error.code == "prompt_too_long"
    assert not error.HasField("retry_after_s")


async def test_a_continuation_fails_at_its_next_sequence_number():
    continuation = Assignment(reply_id="r1", request=request(), first_seq=6)
    result = await dispatch(Workers(d1=Refusal(reason="draining")), continuation, ["d1"], CONFIG)
    assert failure_event(continuation, result, CONFIG).seq == 6


async def test_a_prefill_worker_refusing_for_its_decode_worker_stops_the_round():
    async def assign(worker_id: str, assignment: Assignment) -> AssignmentReply:
        return AssignmentReply(refused=Refusal(reason="no_room"), failed_decode_worker_id="d1")

    result = await dispatch(assign, assignment(), ["p1", "p2", "p3"], CONFIG)
    assert [a.worker_id for a in result.attempts] == ["p1"], "another prefill worker would ask the same decode worker"
    assert result.attempts[0].failed_decode_worker_id == "d1"
