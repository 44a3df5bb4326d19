"""The attach queue: at most its reads at once, a bounded number waiting their turn, and a new
stream past that bound (or past its wait) refused with 503 streams_busy and a Retry-After."""

from __future__ import annotations

import asyncio

import pytest

from services.chat.attach_queue import AttachQueue
from services.chat.errors import Unavailable


async def hold(queue: AttachQueue, wait_s: float, entered: list[int], index: int, release: asyncio.Event) -> None:
    async with queue.turn(wait_s):
        entered.append(index)
        await release.wait()


async def test_at_most_max_reads_run_at_once_and_the_waiting_get_their_turn_in_order():
    queue = AttachQueue(max_reads=2, max_waiting=10)
    entered: list[int] = []
    release = asyncio.Event()
    tasks = [asyncio.create_task(hold(queue, 5.0, entered, i, release)) for i in range(5)]
    await asyncio.sleep(0)
    assert entered == [0, 1] and queue.num_waiting == 3
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert entered == [0, 1, 2, 3, 4] and queue.num_waiting == 0


async def test_past_the_bound_of_waiting_reads_a_new_stream_is_refused_at_once_with_retry_after():
    queue = AttachQueue(max_reads=1, max_waiting=2)
    release = asyncio.Event()
    held = [asyncio.create_task(hold(queue, 5.0, [], i, release)) for i in range(3)]
    await asyncio.sleep(0)
    assert queue.num_waiting == 2
    with pytest.raises(Unavailable) as refused:
        async with queue.turn(5.0):
            pass
    assert refused.value.code == "streams_busy" and refused.value.retry_after_s >= 1
    release.set()
    await asyncio.wait_for(asyncio.gather(*held), timeout=5)


async def test_a_read_whose_turn_does_not_come_within_its_wait_is_refused_and_leaves_the_queue():
    queue = AttachQueue(max_reads=1, max_waiting=5)
    release = asyncio.Event()
    holder = asyncio.create_task(hold(queue, 5.0, [], 0, release))
    await asyncio.sleep(0)
    with pytest.raises(Unavailable) as refused:
        async with queue.turn(0.05):
            pass
    assert refused.value.code == "streams_busy" and queue.num_waiting == 0
    release.set()
    await asyncio.wait_for(holder, timeout=5)
    async with queue.turn(0.05):  # the holder's turn was given back, the timed-out one took none
        pass
