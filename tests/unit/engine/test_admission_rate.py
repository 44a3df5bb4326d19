"""How fast each lane's queue drains: only steps that left some of the lane waiting are measured
for it, over a window of recent seconds (an injected clock); a stuck queue reads as slow (never
infinitely so); and the scheduler counts its admissions per step by lane."""

import pytest

from tandem.engine.admission_rate import AdmissionRate
from tandem.engine.sequence import Lane, SamplingOptions, Sequence

FREE_WAITS = [Lane.FREE]


def steps(rate: AdmissionRate, admitted: dict[Lane, int], step_s: float, count: int, waiting: list[Lane], start_s: float = 0.0) -> float:
    """`count` back-to-back steps from `start_s`; returns when the last one ended."""
    now_s = start_s
    for _ in range(count):
        now_s += step_s
        rate.add_step(admitted, step_s, waiting, now_s)
    return now_s


def test_none_until_a_step_ends_with_some_of_the_lane_still_waiting():
    rate = AdmissionRate()
    rate.add_step({Lane.FREE: 5}, 0.1, [], now_s=0.1)  # the queue ran dry: arrivals, not room, limited it
    assert rate.per_s(Lane.FREE, now_s=0.1) is None
    rate.add_step({Lane.FREE: 2}, 0.1, FREE_WAITS, now_s=0.2)
    assert rate.per_s(Lane.FREE, now_s=0.2) == pytest.approx(20.0)
    assert rate.per_s(Lane.PAID, now_s=0.2) is None


def test_each_lane_drains_at_its_own_rate():
    """Paid goes first: while both wait, the free queue moves only by the free admissions."""
    rate = AdmissionRate()
    now_s = steps(rate, {Lane.PAID: 3, Lane.FREE: 1}, 0.1, 10, [Lane.PAID, Lane.FREE])
    assert rate.per_s(Lane.PAID, now_s) == pytest.approx(30.0)
    assert rate.per_s(Lane.FREE, now_s) == pytest.approx(10.0)


def test_steps_that_admitted_nobody_count_as_time_the_queue_did_not_move():
    rate = AdmissionRate()
    now_s = steps(rate, {Lane.FREE: 1}, 0.1, 1, FREE_WAITS)
    now_s = steps(rate, {}, 0.1, 9, FREE_WAITS, start_s=now_s)
    assert rate.per_s(Lane.FREE, now_s) == pytest.approx(1.0)


def test_a_queue_that_never_moved_reads_as_one_admission_over_the_window():
    rate = AdmissionRate(window_s=2.0)
    now_s = steps(rate, {}, 0.5, 10, FREE_WAITS)
    assert rate.per_s(Lane.FREE, now_s) == pytest.approx(0.4)  # five steps of the last 2 s: at most one admission in 2.5 s


def test_only_the_latest_seconds_count_and_an_old_queue_is_forgotten():
    """A burst admitted fast into an empty engine says nothing once the engine is full, and a rate
    from a queue long gone says nothing of the next one."""
    rate = AdmissionRate(window_s=1.0)
    now_s = steps(rate, {Lane.FREE: 100}, 0.5, 1, FREE_WAITS)
    now_s = steps(rate, {Lane.FREE: 1}, 0.25, 5, FREE_WAITS, start_s=now_s)
    assert rate.per_s(Lane.FREE, now_s) == pytest.approx(4.0)
    now_s = steps(rate, {}, 0.25, 8, [], start_s=now_s)  # two seconds with nothing waiting
    assert rate.per_s(Lane.FREE, now_s) is None


def test_the_scheduler_counts_each_steps_admissions_by_lane(make_engine):
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.scheduler.add(Sequence(f"s{i}", range(100 * i + 1, 100 * i + 6), SamplingOptions(max_tokens=2)))
    plan, _ = engine.step()
    assert plan.num_admitted == {Lane.FREE: 2} and engine.scheduler.waiting_lanes() == [Lane.FREE]
    plan, _ = engine.step()
    assert plan.num_admitted == {}  # both seats still decode
    admitted = [engine.step()[0].num_admitted.get(Lane.FREE, 0) for _ in range(6)]
    assert sum(admitted) == 3 and engine.scheduler.waiting_lanes() == []
