"""A stack's processes as the stack benches see them through /proc (Linux): CPU time, descendants
(a worker's engine process), pinning, and CPU seconds by role over a phase."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tandem.devstack.stack import Stack


def cpu_s(pid: int) -> float:
    """A process's CPU time so far, user and system (/proc/<pid>/stat); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (a worker's engine process)."""
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for thread in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                for child in Path(f"/proc/{pid}/task/{thread}/children").read_text().split():
                    found += [int(child), *descendants(int(child))]
    return found


def pin(pid: int, cpus: frozenset[int], with_children: bool = True) -> None:
    """The process, every thread it has now and (`with_children`) every process it started, as a
    worker's engine process, on `cpus` (threads and processes started later inherit it)."""
    for process in (pid, *(descendants(pid) if with_children else ())):
        with contextlib.suppress(FileNotFoundError):
            for thread in os.listdir(f"/proc/{process}/task"):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(int(thread), cpus)


def processes_by_role(stack: Stack) -> dict[str, list[int]]:
    """Each role's service processes in the stack, and apart the processes they started (a
    worker's engine process, a chat's or relay's safety check) as "<role>, started by it"."""
    groups: dict[str, list[int]] = {}
    for member in stack.members:
        if member.pid is not None:
            groups.setdefault(member.role, []).append(member.pid)
            if children := descendants(member.pid):
                groups.setdefault(f"{member.role}, started by it", []).extend(children)
    return groups


class CpuMeter:
    """CPU seconds each group of processes spends between `start` and `stop`."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self._before: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return {name: sum(cpu_s(pid) for pid in pids) for name, pids in self.groups.items()}

    def start(self) -> None:
        self._before = self._now()

    def stop(self) -> dict[str, float]:
        return {name: round(spent - self._before[name], 1) for name, spent in self._now().items()}
