import pytest

from tandem.engine.prefill_rate import PrefillRate

BUDGET = 512


def test_the_rate_is_zero_until_a_large_prefilling_step_is_measured():
    rate = PrefillRate(BUDGET, num_warmup_steps=0)
    rate.add_step(0, 0.5, num_decode_tokens=300)  # decode-only
    rate.add_step(300, 0.0)  # no measurable time
    rate.add_step(20, 0.1, num_decode_tokens=20)  # small: its fixed cost says nothing of a full step
    assert rate.prefill_tokens_per_s(0) == 0.0
    rate.add_step(100, 0.5, num_decode_tokens=28)  # a quarter of the budget
    assert rate.prefill_tokens_per_s(0) == pytest.approx(256.0)


def test_decode_rows_of_a_large_step_count_and_decodes_take_their_rows_of_the_budget():
    rate = PrefillRate(BUDGET, num_warmup_steps=0)
    rate.add_step(312, 0.5, num_decode_tokens=200)
    assert rate.rows_per_s == pytest.approx(1024.0)
    assert rate.prefill_tokens_per_s(128) == pytest.approx(768.0)
    assert rate.prefill_tokens_per_s(1000) == pytest.approx(128.0), "never below an eighth of the budget"


def test_small_mixed_steps_do_not_make_a_full_prefill_look_slow():
    """The old measure (prefill tokens over the whole step) read 4 / 0.09 = 44 tokens/s here."""
    rate = PrefillRate(BUDGET, num_warmup_steps=0)
    rate.add_step(400, 0.45)
    for _ in range(10):
        rate.add_step(4, 0.09, num_decode_tokens=36)  # a continuation's last tokens beside 36 decodes
    assert rate.prefill_tokens_per_s(36) == pytest.approx(400 / 0.45 * (BUDGET - 36) / BUDGET)


def test_one_stalled_step_does_not_move_the_rate():
    """Descheduled for seconds while another process loaded a model on the same cores."""
    rate = PrefillRate(BUDGET, num_warmup_steps=0)
    for _ in range(4):
        rate.add_step(400, 0.5)
    rate.add_step(400, 8.0)
    assert rate.prefill_tokens_per_s(0) == pytest.approx(800.0)


def test_the_warm_up_step_is_not_measured():
    rate = PrefillRate(BUDGET, num_warmup_steps=1)
    rate.add_step(0, 3.0, num_decode_tokens=4)  # a decode-only step is no warm-up of prefill
    rate.add_step(400, 3.6)  # the first forward: allocations, kernel selection
    assert rate.prefill_tokens_per_s(0) == 0.0
    rate.add_step(512, 0.1)
    assert rate.prefill_tokens_per_s(0) == pytest.approx(5120)


def test_slow_steps_are_forgotten_as_large_steps_go_by():
    rate = PrefillRate(BUDGET, num_steps=9, num_warmup_steps=0)
    for _ in range(9):
        rate.add_step(512, 10.0)
    for _ in range(5):
        rate.add_step(512, 0.1)
    assert rate.prefill_tokens_per_s(0) == pytest.approx(5120)
