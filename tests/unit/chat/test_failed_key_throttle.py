"""Failed keys per address (services.chat.auth_throttle) on the test's clock: past max_failures in
the window an address waits until its oldest failure leaves it; other addresses never wait; the
addresses remembered are bounded."""

from __future__ import annotations

from services.chat.auth_throttle import FailedKeyThrottle, ThrottleConfig


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_an_address_past_its_failures_waits_until_the_oldest_leaves_the_window():
    clock = Clock()
    throttle = FailedKeyThrottle(ThrottleConfig(max_failures=3, window_s=60.0), clock)
    for step_s in (0.0, 10.0, 10.0):
        assert throttle.retry_after_s("10.0.0.1") == 0.0
        clock.now_s += step_s
        throttle.record_failure("10.0.0.1")
    assert throttle.retry_after_s("10.0.0.1") == 40.0  # the first failure, 20 s ago, leaves in 40 s
    assert throttle.retry_after_s("10.0.0.2") == 0.0
    clock.now_s += 40.0
    assert throttle.retry_after_s("10.0.0.1") == 0.0
    throttle.record_failure("10.0.0.1")  # three in the window again: the 2nd, 3rd and this
    assert throttle.retry_after_s("10.0.0.1") == 10.0


def test_the_addresses_remembered_are_bounded_oldest_first():
    throttle = FailedKeyThrottle(ThrottleConfig(max_failures=1, window_s=60.0, max_addresses=2), Clock())
    for address in ("a", "b", "c"):
        throttle.record_failure(address)
    assert throttle.retry_after_s("a") == 0.0
    assert throttle.retry_after_s("b") > 0 and throttle.retry_after_s("c") > 0
