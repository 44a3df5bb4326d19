"""The stall rule: a running reply is lost when no live worker claims it and its current owner
makes no progress (no event for the stall timeout once it produced, or none within the dispatch
grace while it has not). A settable clock stands in for the wall clock."""

from __future__ import annotations

from services.relay.stalls import Claims, StallConfig, continuation_request, is_stalled
from tandem.bus.events import ReplyStatus
from tandem.tokenlog import ReplyMeta
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat

CONFIG = StallConfig(stall_timeout_s=2.0, dispatch_grace_s=10.0, max_continuations=3, running_ttl_s=3600)
START_MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now_ms = START_MS

    def __call__(self) -> int:
        return self.now_ms


def listening(clock: Clock, listened_ms: int = 60_000) -> Claims:
    """Claims that started listening `listened_ms` before the clock's now, hearing another live
    worker's heartbeat every half second since."""
    claims = Claims(clock)
    clock.now_ms -= listened_ms
    claims.observe_connection(True)
    advance(clock, claims, listened_ms)
    return claims


def advance(clock: Clock, claims: Claims, duration_ms: int) -> None:
    """Time passes while another worker (claiming nothing of interest) heartbeats every 500 ms."""
    end_ms = clock.now_ms + duration_ms
    while clock.now_ms < end_ms:
        clock.now_ms = min(end_ms, clock.now_ms + 500)
        claims.note(WorkerHeartbeat(reply_ids=["another-reply"]))


def reply(clock: Clock, *, created_ago_ms: int, last_event_ago_ms: int | None = None, **fields) -> ReplyMeta:
    last_event_ms = 0 if last_event_ago_ms is None else clock.now_ms - last_event_ago_ms
    return ReplyMeta(reply_id="r1", created_ms=clock.now_ms - created_ago_ms, last_event_ms=last_event_ms, **fields)


def test_a_reply_that_produced_and_then_went_silent_unclaimed_is_stalled():
    clock = Clock()
    assert is_stalled(reply(clock, created_ago_ms=30_000, last_event_ago_ms=2_500), listening(clock), CONFIG, clock())


def test_a_reply_still_producing_is_not_stalled():
    clock = Clock()
    assert not is_stalled(reply(clock, created_ago_ms=30_000, last_event_ago_ms=500), listening(clock), CONFIG, clock())


def test_a_silent_reply_is_not_stalled_while_a_worker_claims_it_and_is_once_the_claims_lapse():
    clock = Clock()
    claims = listening(clock)
    claims.note(WorkerHeartbeat(reply_ids=["r1"]))
    silent = reply(clock, created_ago_ms=30_000, last_event_ago_ms=25_000)
    assert not is_stalled(silent, claims, CONFIG, clock())
    advance(clock, claims, 2_500)  # the worker's heartbeats stopped
    assert is_stalled(silent, claims, CONFIG, clock())


def test_a_reply_that_has_produced_nothing_gets_the_dispatch_grace():
    clock = Clock()
    claims = listening(clock)
    assert not is_stalled(reply(clock, created_ago_ms=5_000), claims, CONFIG, clock())
    assert is_stalled(reply(clock, created_ago_ms=11_000), claims, CONFIG, clock())


def test_a_continued_reply_gets_the_dispatch_grace_again_until_its_new_owner_produces():
    clock = Clock()
    continued_ms = clock.now_ms - 5_000
    waiting = reply(clock, created_ago_ms=60_000, last_event_ago_ms=20_000, continued_ms=continued_ms)
    assert not is_stalled(waiting, listening(clock), CONFIG, clock())
    produced_then_silent = reply(clock, created_ago_ms=60_000, last_event_ago_ms=3_000, continued_ms=continued_ms)
    assert is_stalled(produced_then_silent, listening(clock), CONFIG, clock())


def test_a_relay_that_has_not_heard_a_round_of_heartbeats_calls_nothing_stalled():
    clock = Clock()
    silent = reply(clock, created_ago_ms=30_000, last_event_ago_ms=25_000)
    assert not is_stalled(silent, listening(clock, listened_ms=1_000), CONFIG, clock())
    claims = listening(clock)
    claims.observe_connection(False)  # NATS went away: the claims it holds are no longer news
    claims.observe_connection(True)
    assert not is_stalled(silent, claims, CONFIG, clock())
    advance(clock, claims, 2_000)
    assert is_stalled(silent, claims, CONFIG, clock())


def test_finished_or_idle_cancelled_replies_are_never_stalled():
    clock = Clock()
    claims = listening(clock)
    assert not is_stalled(reply(clock, created_ago_ms=30_000, status=ReplyStatus.COMPLETE), claims, CONFIG, clock())
    assert not is_stalled(reply(clock, created_ago_ms=30_000, cancel_sent_ms=clock.now_ms - 20_000), claims, CONFIG, clock())


def test_a_claim_counts_for_the_time_asked_from_its_last_heartbeat():
    clock = Clock()
    claims = listening(clock)
    claims.note(WorkerHeartbeat(reply_ids=["r1", "r2"]))
    clock.now_ms += 5_000
    claims.note(WorkerHeartbeat(reply_ids=["r1"]))
    claims.forget_older_than(4_000)
    assert claims.is_claimed("r1", within_ms=2_000)
    assert not claims.is_claimed("r2", within_ms=2_000)


def test_a_reply_lost_before_its_first_token_is_stalled_once_its_claims_lapse_not_after_the_grace():
    clock = Clock()
    claims = listening(clock)
    fresh = reply(clock, created_ago_ms=1_000)  # dispatched 1 s ago, nothing logged yet
    claims.note(WorkerHeartbeat(reply_ids=["r1"]))  # a worker took it
    assert not is_stalled(fresh, claims, CONFIG, clock())
    advance(clock, claims, 2_500)  # that worker died before its first token: its heartbeats stopped
    assert is_stalled(fresh, claims, CONFIG, clock())


def test_a_claim_heard_before_the_reply_was_continued_does_not_count_as_its_new_owner():
    clock = Clock()
    claims = listening(clock)
    claims.note(WorkerHeartbeat(reply_ids=["r1"]))  # the old owner, before the continuation
    advance(clock, claims, 3_000)
    continued = reply(clock, created_ago_ms=30_000, continued_ms=clock.now_ms - 500)
    assert not is_stalled(continued, claims, CONFIG, clock())  # the router may still be placing it


def test_while_no_worker_is_heard_at_all_silence_is_not_a_stall_until_the_hard_limit():
    clock = Clock()
    claims = listening(clock)
    silent = reply(clock, created_ago_ms=30_000, last_event_ago_ms=500)
    clock.now_ms += 10_000  # NATS paused: no heartbeat from anyone, no event
    assert not is_stalled(silent, claims, CONFIG, clock())
    advance(clock, claims, 1_000)  # the bus is back: a fresh round of heartbeats first
    assert not is_stalled(silent, claims, CONFIG, clock())
    advance(clock, claims, 1_500)
    assert is_stalled(silent, claims, CONFIG, clock())


def test_a_reply_silent_past_the_hard_limit_is_stalled_even_when_no_worker_is_heard():
    clock = Clock()
    claims = listening(clock)
    silent = reply(clock, created_ago_ms=120_000, last_event_ago_ms=61_000)
    assert is_stalled(silent, claims, CONFIG, clock())


def test_a_reply_whose_worker_a_ping_found_gone_is_stalled_at_once():
    clock = Clock()
    claims = listening(clock)
    claims.note(WorkerHeartbeat(service=ServiceHeartbeat(instance_id="decode-0"), reply_ids=["r1"]))
    producing = reply(clock, created_ago_ms=30_000, last_event_ago_ms=600)
    assert claims.claimer("r1") == "decode-0"
    assert not is_stalled(producing, claims, CONFIG, clock())
    claims.note_gone("decode-0")
    assert is_stalled(producing, claims, CONFIG, clock())  # not 2 s later: its process is gone


def test_a_worker_restarted_under_the_same_id_does_not_bring_its_lost_replies_back():
    clock = Clock()
    claims = listening(clock)
    claims.note(WorkerHeartbeat(service=ServiceHeartbeat(instance_id="decode-0"), reply_ids=["r1"]))
    fresh = reply(clock, created_ago_ms=1_000)  # lost before its first token
    advance(clock, claims, 200)
    claims.note_gone("decode-0")
    advance(clock, claims, 300)
    claims.note(WorkerHeartbeat(service=ServiceHeartbeat(instance_id="decode-0"), reply_ids=[]))  # back, holding nothing
    assert claims.lost_ms("r1") > 0 and not claims.is_claimed("r1", within_ms=2_000)
    assert is_stalled(fresh, claims, CONFIG, clock())
    claims.note(WorkerHeartbeat(service=ServiceHeartbeat(instance_id="decode-1"), reply_ids=["r1"]))  # its new owner
    assert claims.is_claimed("r1", within_ms=2_000)


def test_events_logged_after_the_worker_was_found_gone_are_its_backlog_not_a_sign_of_life():
    clock = Clock()
    claims = listening(clock)
    claims.note(WorkerHeartbeat(service=ServiceHeartbeat(instance_id="decode-0"), reply_ids=["r1"]))
    advance(clock, claims, 200)
    claims.note_gone("decode-0")
    advance(clock, claims, 300)
    lagging = reply(clock, created_ago_ms=30_000, last_event_ago_ms=100)  # the relay logged its backlog late
    assert is_stalled(lagging, claims, CONFIG, clock())


def test_finding_the_previous_owner_gone_again_does_not_make_a_continuation_look_lost():
    clock = Clock()
    claims = listening(clock)
    claims.note(WorkerHeartbeat(service=ServiceHeartbeat(instance_id="decode-0"), reply_ids=["r1"]))
    advance(clock, claims, 200)
    claims.note_gone("decode-0")
    advance(clock, claims, 300)
    continued = reply(clock, created_ago_ms=30_000, last_event_ago_ms=1_000, continued_ms=clock.now_ms)  # sent to another worker
    advance(clock, claims, 600)
    claims.note_gone("decode-0")  # pinged again before the new owner's first heartbeat claims it
    assert not is_stalled(continued, claims, CONFIG, clock())


def test_a_continuation_resumes_on_the_version_that_answered_the_reply():
    asked = GenerateRequest(reply_id="r1", model="smol", prompt_token_ids=[1, 2], generated_token_ids=[9]).SerializeToString()
    resumed = continuation_request(ReplyMeta(reply_id="r1", model="smol@2", request=asked), [5, 6, 7], epoch=2)
    assert (resumed.model, resumed.resume_reply_id, list(resumed.generated_token_ids), resumed.epoch) == ("smol@2", "r1", [5, 6, 7], 2)
    unversioned = continuation_request(ReplyMeta(reply_id="r1", model="other", request=asked), [5], epoch=1)
    assert unversioned.model == "smol"  # another pool answered it: the request's own model, as before
