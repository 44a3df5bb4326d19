"""How fast the queue drains: only steps that left sequences waiting are measured, a stuck
queue reads as slow (never infinitely so), and the scheduler counts its admissions per step."""

import pytest

from tandem.engine.admission_rate import AdmissionRate
from tandem.engine.sequence import SamplingOptions, Sequence


def test_none_until_a_step_ends_with_sequences_still_waiting():
    rate = AdmissionRate()
    rate.add_step(5, 0.1, is_queue_left=False)  # the queue ran dry: arrivals, not room, limited it
    assert rate.per_s is None
    rate.add_step(2, 0.1, is_queue_left=True)
    assert rate.per_s == pytest.approx(20.0)


def test_steps_that_admitted_nobody_count_as_time_the_queue_did_not_move():
    rate = AdmissionRate()
    rate.add_step(1, 0.1, is_queue_left=True)
    for _ in range(9):
        rate.add_step(0, 0.1, is_queue_left=True)
    assert rate.per_s == pytest.approx(1.0)


def test_a_queue_that_never_moved_reads_as_one_admission_over_the_window():
    rate = AdmissionRate(num_steps=4)
    for _ in range(10):
        rate.add_step(0, 0.5, is_queue_left=True)
    assert rate.per_s == pytest.approx(0.5)  # one admission per 2 s at most


def test_only_the_latest_steps_count():
    rate = AdmissionRate(num_steps=2)
    rate.add_step(100, 0.1, is_queue_left=True)
    rate.add_step(1, 0.1, is_queue_left=True)
    rate.add_step(1, 0.1, is_queue_left=True)
    assert rate.per_s == pytest.approx(10.0)


def test_the_scheduler_counts_each_steps_admissions(make_engine):
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.scheduler.add(Sequence(f"s{i}", range(100 * i + 1, 100 * i + 6), SamplingOptions(max_tokens=2)))
    plan, _ = engine.step()
    assert plan.num_admitted == 2 and engine.scheduler.has_waiting()
    plan, _ = engine.step()
    assert plan.num_admitted == 0  # both seats still decode
    admitted = [engine.step()[0].num_admitted for _ in range(6)]
    assert sum(admitted) == 3 and not engine.scheduler.has_waiting()
