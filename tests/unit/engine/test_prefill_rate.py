import pytest

from tandem.engine.prefill_rate import PrefillRate

BUDGET = 512


def test_the_rate_is_zero_until_a_step_with_prefill_work_is_measured():
    rate = PrefillRate(num_warmup_steps=0)
    rate.add_step(0, 0.5, num_decode_tokens=0)  # nothing computed
    rate.add_step(100, 0.0)  # no measurable time
    rate.add_step(0, 0.5, num_decode_tokens=8)  # decode-only: a cost, but nothing prefilled yet
    assert rate.prefill_tokens_per_s(BUDGET, 0) == 0.0
    rate.add_step(100, 0.5)
    assert rate.prefill_tokens_per_s(BUDGET, 0) > 0.0


def test_the_fixed_cost_and_the_cost_per_row_are_fitted():
    """Steps of 0.05 s + 1 ms per row: a full step of 512 prompt tokens takes 0.562 s."""
    rate = PrefillRate(num_warmup_steps=0)
    for rows in (8, 20, 40, 100, 300, 512, 16, 64):
        rate.add_step(rows // 2, 0.05 + 0.001 * rows, num_decode_tokens=rows - rows // 2)
    fixed, per_row = rate.step_cost()
    assert (fixed, per_row) == (pytest.approx(0.05), pytest.approx(0.001))
    assert rate.prefill_tokens_per_s(BUDGET, 0) == pytest.approx(512 / 0.562)
    assert rate.prefill_tokens_per_s(BUDGET, 128) == pytest.approx(384 / 0.562), "a row of each step per decode"
    assert rate.prefill_tokens_per_s(BUDGET, 1000) == pytest.approx(64 / 0.562), "never below an eighth of the budget"


def test_small_mixed_steps_do_not_make_a_full_prefill_look_slow():
    """The old measure (prefill tokens over the whole step) read 4 / 0.09 = 44 tokens/s here."""
    rate = PrefillRate(num_warmup_steps=0)
    rate.add_step(400, 0.45)
    for _ in range(10):
        rate.add_step(4, 0.09, num_decode_tokens=36)  # a continuation's last tokens beside 36 decodes
    assert rate.prefill_tokens_per_s(BUDGET, 36) > 700


def test_one_stalled_step_does_not_move_the_rate():
    """Descheduled for seconds while another process loaded a model on the same cores."""
    rate = PrefillRate(num_warmup_steps=0)
    for rows in (40, 100, 200, 400, 40, 100, 200, 400):
        rate.add_step(rows, 0.05 + 0.001 * rows)
    before = rate.prefill_tokens_per_s(BUDGET, 0)
    rate.add_step(400, 8.0)
    assert rate.prefill_tokens_per_s(BUDGET, 0) == pytest.approx(before, rel=0.05)


def test_the_warm_up_steps_are_not_measured():
    rate = PrefillRate(num_warmup_steps=1)
    rate.add_step(0, 3.0, num_decode_tokens=4)  # a decode-only step is no warm-up of prefill
    rate.add_step(40, 3.6)  # the first forward: allocations, kernel selection
    assert rate.prefill_tokens_per_s(BUDGET, 0) == 0.0
    rate.add_step(512, 0.1)
    assert rate.prefill_tokens_per_s(BUDGET, 0) == pytest.approx(5120)


def test_slow_steps_are_forgotten_as_steps_go_by():
    rate = PrefillRate(num_steps=8, num_warmup_steps=0)
    for _ in range(8):
        rate.add_step(512, 10.0)
    for _ in range(8):
        rate.add_step(512, 0.1)
    assert rate.prefill_tokens_per_s(BUDGET, 0) == pytest.approx(5120)
