"""The engine thread's death: an exception out of a step (or out of loading) ends the thread,
tells the loop once, and no call waits forever on an engine that will never answer."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.worker.thread import EngineDead, EngineThread


class StepFails:
    """An engine (to the thread) whose first step raises, as a CUDA error or a bug would."""

    def __init__(self) -> None:
        self.has_queued = False
        self.is_stepping = threading.Event()
        self.may_step = threading.Event()

    def has_work(self) -> bool:
        return self.has_queued

    def stats(self) -> None:
        return None

    def step(self) -> list:
        self.is_stepping.set()
        self.may_step.wait(10)
        raise IndexError("index out of range in self")


async def test_a_step_that_raises_ends_the_thread_and_every_call_then_raises_engine_dead():
    engine = StepFails()
    deaths: list[BaseException] = []
    died = asyncio.Event()

    def on_death(exc: BaseException) -> None:
        deaths.append(exc)
        died.set()

    thread = EngineThread(lambda: engine, lambda outputs: None, asyncio.get_running_loop(), on_death=on_death)  # type: ignore[arg-type, return-value]
    thread.start()
    assert await thread.call(lambda e: "loaded") == "loaded"
    thread.post(lambda e: setattr(e, "has_queued", True))
    assert await asyncio.to_thread(engine.is_stepping.wait, 10)
    waiting = asyncio.ensure_future(thread.call(lambda e: "never"))  # queued behind the failing step
    await asyncio.sleep(0)  # the call is queued
    engine.may_step.set()
    await asyncio.wait_for(died.wait(), 10)
    assert len(deaths) == 1 and isinstance(deaths[0], IndexError)
    assert thread.death is deaths[0] and not thread.is_ready
    with pytest.raises(EngineDead):
        await asyncio.wait_for(waiting, 10)
    with pytest.raises(EngineDead):
        await thread.call(lambda e: "after")


async def test_an_engine_that_fails_to_load_is_a_death_too():
    died: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    def build():
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    thread = EngineThread(build, lambda outputs: None, asyncio.get_running_loop(), on_death=died.set_result)
    thread.start()
    assert isinstance(await asyncio.wait_for(died, 10), RuntimeError)
    assert not thread.is_ready
    with pytest.raises(EngineDead):
        await thread.call(lambda e: None)


class CountsAdds:
    """An engine (to the thread) whose stats are the number of adds it has taken."""

    def __init__(self) -> None:
        self.num_added = 0

    def has_work(self) -> bool:
        return False

    def stats(self) -> int:
        return self.num_added

    def close(self) -> None:
        """What a stopped engine thread calls last (a tensor-parallel engine's ranks end there)."""


async def test_the_latest_stats_name_how_many_posted_changes_they_include():
    engine = CountsAdds()
    thread = EngineThread(lambda: engine, lambda outputs: None, asyncio.get_running_loop())  # type: ignore[arg-type, return-value]
    thread.start()
    try:
        tickets = [thread.post(lambda e: setattr(e, "num_added", e.num_added + 1)) for _ in range(3)]
        assert tickets == [1, 2, 3]
        deadline = asyncio.get_running_loop().time() + 10
        while (snapshot := thread.snapshot) is None or snapshot[1] < tickets[-1]:
            assert asyncio.get_running_loop().time() < deadline, "the posted changes were never applied"
            await asyncio.sleep(0.01)
        stats, num_applied = snapshot
        assert (stats, num_applied) == (3, 3)  # type: ignore[comparison-overlap]
        assert await thread.call(lambda e: e.num_added) == 3
    finally:
        await asyncio.to_thread(thread.stop)
