"""The event loop's lag is measured: a loop held up by blocking work shows it in
tandem_event_loop_lag_seconds, a free one shows next to none."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from tandem.runtime.loop_lag import watch_loop_lag


def lag_samples() -> tuple[float, float]:
    count = REGISTRY.get_sample_value("tandem_event_loop_lag_seconds_count") or 0.0
    return count, REGISTRY.get_sample_value("tandem_event_loop_lag_seconds_sum") or 0.0


async def test_a_loop_held_up_by_blocking_work_shows_its_lag():
    count, total = lag_samples()
    watcher = asyncio.create_task(watch_loop_lag(interval_s=0.01))
    try:
        await asyncio.sleep(0.05)  # a free loop: the timer fires about on time
        time.sleep(0.3)  # blocking work holds the loop
        deadline = time.monotonic() + 5.0
        while lag_samples()[1] - total < 0.2 and time.monotonic() < deadline:  # the late timer counts once the loop runs
            await asyncio.sleep(0.01)
    finally:
        watcher.cancel()
    new_count, new_total = lag_samples()
    assert new_count >= count + 2
    assert 0.2 <= new_total - total < 5.0
