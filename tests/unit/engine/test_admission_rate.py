"""How fast each lane's queue drains: only steps that left some of the lane waiting are measured
for it, over a window of recent seconds; a stuck queue reads as slow (never infinitely so); and
the scheduler counts its admissions per step by lane."""

import pytest

from tandem.engine.admission_rate import AdmissionRate
from tandem.engine.sequence import Lane, SamplingOptions, Sequence

FREE_WAITS = [Lane.FREE]


def test_none_until_a_step_ends_with_some_of_the_lane_still_waiting():
    rate = AdmissionRate()
    rate.add_step({Lane.FREE: 5}, 0.1, waiting_lanes=[])  # the queue ran dry: arrivals, not room, limited it
    assert rate.per_s(Lane.FREE) is None
    rate.add_step({Lane.FREE: 2}, 0.1, waiting_lanes=FREE_WAITS)
    assert rate.per_s(Lane.FREE) == pytest.approx(20.0)
    assert rate.per_s(Lane.PAID) is None


def test_each_lane_drains_at_its_own_rate():
    """Paid goes first: while both wait, the free queue moves only by the free admissions."""
    rate = AdmissionRate()
    for _ in range(10):
        rate.add_step({Lane.PAID: 3, Lane.FREE: 1}, 0.1, waiting_lanes=[Lane.PAID, Lane.FREE])
    assert rate.per_s(Lane.PAID) == pytest.approx(30.0)
    assert rate.per_s(Lane.FREE) == pytest.approx(10.0)


def test_steps_that_admitted_nobody_count_as_time_the_queue_did_not_move():
    rate = AdmissionRate()
    rate.add_step({Lane.FREE: 1}, 0.1, waiting_lanes=FREE_WAITS)
    for _ in range(9):
        rate.add_step({}, 0.1, waiting_lanes=FREE_WAITS)
    assert rate.per_s(Lane.FREE) == pytest.approx(1.0)


def test_a_queue_that_never_moved_reads_as_one_admission_over_the_window():
    rate = AdmissionRate(window_s=2.0)
    for _ in range(10):
        rate.add_step({}, 0.5, waiting_lanes=FREE_WAITS)
    assert rate.per_s(Lane.FREE) == pytest.approx(0.5)  # one admission per 2 s at most


def test_only_the_latest_seconds_count():
    """A burst admitted fast into an empty engine says nothing once the engine is full."""
    rate = AdmissionRate(window_s=1.0)
    rate.add_step({Lane.FREE: 100}, 0.5, waiting_lanes=FREE_WAITS)
    for _ in range(5):
        rate.add_step({Lane.FREE: 1}, 0.25, waiting_lanes=FREE_WAITS)
    assert rate.per_s(Lane.FREE) == pytest.approx(4.0)


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
