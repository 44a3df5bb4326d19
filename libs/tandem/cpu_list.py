"""Linux's CPU list form (`0`, `0-3`, `0,2-3`), as settings.cpu_affinity and the benches' CPU
flags give it."""

from __future__ import annotations

import re

_CPU_RANGE = re.compile(r"^(?P<first>\d+)(?:-(?P<last>\d+))?$")
MAX_CPU_ID = 4095


def parse_cpu_list(spec: str) -> frozenset[int]:
    """`0`, `0-3`, `0,2-3` (Linux's cpu list form) -> the CPU ids; "" -> none."""
    cpus: set[int] = set()
    for item in (part.strip() for part in spec.split(",")) if spec.strip() else ():
        match = _CPU_RANGE.match(item)
        if match is None:
            raise ValueError(f"{item!r} is not a CPU or a range of CPUs (write 0, 0-3 or 0,2-3)")
        first, last = int(match["first"]), int(match["last"] or match["first"])
        if last < first or last > MAX_CPU_ID:
            raise ValueError(f"{item!r} is not a range of CPUs from low to high, at most {MAX_CPU_ID}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)
