"""TANDEM_CPU_AFFINITY: parsed as Linux's cpu list form, refused clearly when malformed or naming a
CPU the process may not use, and applied to every thread of the process."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
from pydantic import ValidationError

from tandem.config import Settings, parse_cpu_list
from tandem.errors import StartupError
from tandem.runtime.affinity import format_cpus, pin_process

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this system")


def test_cpu_lists_are_single_cpus_and_ranges():
    assert parse_cpu_list("") == frozenset()
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("0-2, 5,7-8") == {0, 1, 2, 5, 7, 8}
    assert format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize("spec", ["a", "1-", "3-1", "-1", "0,,1", "1.5", "0-99999"])
def test_a_malformed_cpu_list_is_refused_naming_the_setting(spec):
    with pytest.raises(ValidationError) as error:
        Settings(cpu_affinity=spec)
    assert "cpu_affinity" in str(error.value)


@needs_affinity
def test_a_cpu_the_process_may_not_use_is_a_startup_error():
    beyond = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(StartupError, match="TANDEM_CPU_AFFINITY"):
        pin_process(frozenset({beyond}))


@needs_affinity
def test_every_thread_already_running_and_every_new_one_is_pinned():
    """In a child process of its own (pinning the test runner would slow every later test)."""
    context = multiprocessing.get_context("spawn")
    cpu = min(os.sched_getaffinity(0))
    with context.Pool(1) as pool:
        before, after_old, after_new = pool.apply(_pin_in_child, (cpu,))
    assert before == os.sched_getaffinity(0)  # the child started on all of the runner's CPUs
    assert after_old == after_new == {cpu}


def _pin_in_child(cpu: int) -> tuple[set[int], set[int], set[int]]:
    started = threading.Event()
    stop = threading.Event()
    seen: dict[str, set[int]] = {}

    def old_thread() -> None:
        started.set()
        stop.wait(timeout=30)
        seen["old"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=old_thread)
    thread.start()
    started.wait(timeout=30)
    before = os.sched_getaffinity(0)
    pin_process(frozenset({cpu}))
    new = threading.Thread(target=lambda: seen.__setitem__("new", os.sched_getaffinity(0)))
    new.start()
    new.join(timeout=30)
    stop.set()
    thread.join(timeout=30)
    return before, seen["old"], seen["new"]
