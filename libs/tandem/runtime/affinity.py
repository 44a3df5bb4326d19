"""TANDEM_CPU_AFFINITY: a service's process kept to the CPUs it names, every thread of it, so a
prefill and a decode worker (or a worker and the chat beside it) on one machine do not take
each other's cores."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tandem.errors import StartupError

log = logging.getLogger(__name__)

SETTING = "TANDEM_CPU_AFFINITY"


def pin_process(cpus: frozenset[int]) -> None:
    """Every thread of this process (and every thread it starts later) to `cpus`; nothing when
    empty. A CPU this process may not use, or a system without affinity, is a StartupError."""
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise StartupError(f"{SETTING} needs Linux (this system has no CPU affinity): unset it")
    allowed = os.sched_getaffinity(0)
    if missing := sorted(cpus - allowed):
        raise StartupError(f"{SETTING}: CPU {missing} is not one this process may use (it may use {format_cpus(allowed)})")
    # A thread's mask is its own: set the threads already running (an import may have started
    # some), then new threads inherit it from whichever thread starts them.
    for task in _thread_ids():
        try:
            os.sched_setaffinity(task, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    log.info("on CPUs %s (%s)", format_cpus(cpus), SETTING)


def _thread_ids() -> list[int]:
    try:
        return [int(entry.name) for entry in Path("/proc/self/task").iterdir()]
    except OSError:  # no /proc: this thread only
        return [0]


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in ranges)
