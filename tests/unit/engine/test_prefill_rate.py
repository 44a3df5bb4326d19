import pytest

from tandem.engine.prefill_rate import PrefillRate


def test_the_rate_is_zero_until_a_step_with_prefill_work_is_measured():
    rate = PrefillRate(num_warmup_steps=0)
    rate.add_step(0, 0.5)  # a decode-only step
    rate.add_step(100, 0.0)  # no measurable time
    assert rate.tokens_per_s == 0.0
    rate.add_step(100, 0.5)
    assert rate.tokens_per_s == pytest.approx(200.0)


def test_one_stalled_step_does_not_move_the_rate():
    """Descheduled for seconds while another process loaded a model on the same cores."""
    rate = PrefillRate(num_steps=9, num_warmup_steps=0)
    for _ in range(4):
        rate.add_step(400, 1.0)
    rate.add_step(400, 8.0)
    assert rate.tokens_per_s == pytest.approx(400.0)


def test_the_warm_up_steps_are_not_measured():
    rate = PrefillRate(num_warmup_steps=1)
    rate.add_step(0, 3.0)  # a decode-only step is no warm-up of prefill
    rate.add_step(40, 3.6)  # the first forward: allocations, kernel selection
    assert rate.tokens_per_s == 0.0
    rate.add_step(512, 0.1)
    assert rate.tokens_per_s == pytest.approx(5120)


def test_slow_steps_are_forgotten_as_steps_go_by():
    rate = PrefillRate(num_steps=9, num_warmup_steps=0)
    for _ in range(9):
        rate.add_step(512, 10.0)
    for _ in range(5):
        rate.add_step(512, 0.1)
    assert rate.tokens_per_s == pytest.approx(5120)


def test_decode_rows_of_a_mixed_step_count_as_the_work_it_did():
    """A step of 20 prompt tokens beside 200 decodes took its time for 220 rows, not 20."""
    rate = PrefillRate(num_warmup_steps=0)
    rate.add_step(20, 0.5, num_decode_tokens=200)
    assert rate.tokens_per_s == pytest.approx(440.0)


def test_a_queued_prefill_gets_the_budget_less_a_row_per_running_decode():
    rate = PrefillRate(num_warmup_steps=0)
    rate.add_step(512, 1.0)
    assert rate.prefill_tokens_per_s(512, 0) == pytest.approx(512.0)
    assert rate.prefill_tokens_per_s(512, 128) == pytest.approx(384.0)
    assert rate.prefill_tokens_per_s(512, 1000) == pytest.approx(64.0), "never below an eighth of the budget"
    assert PrefillRate().prefill_tokens_per_s(512, 0) == 0.0, "not measured yet"
