"""Python's cyclic collector in a long-running service. What a service holds once started
(imported modules, its model, tokenizer, clients) lives as long as the process, so it is frozen
out of the collector, whose full passes would otherwise walk all of it each time; and a full
pass comes after 1,000 passes of the middle generation, not 10. Every pass is timed
(tandem_gc_pause_seconds, by generation, and the longest): the event loop stands still through
it, so a full pass over a chat holding thousands of streams is a pause every stream feels."""

from __future__ import annotations

import gc
import time
from typing import Any

from tandem import metrics

# Python's defaults (700, 10, 10) but for full passes, which come after 1,000 passes of the middle
# generation. A chat holding thousands of streams tracks hundreds of objects a stream, and each
# full pass walks them all while the loop stands still. Frozen and after 100 middle passes, a
# chat holding many streams (bench/stream_fanout.py) still paused for full passes that collected
# almost nothing (the young and middle passes collect the garbage), and they showed in the delay
# from a token's production to its write; after 1,000, no full pass came in the same run and the
# delay's p99 fell.
YOUNG_THRESHOLD, MIDDLE_THRESHOLD, FULL_THRESHOLD = 700, 10, 1000


class PassTimer:
    """A gc callback that times each pass into the metrics."""

    def __init__(self) -> None:
        self._started_s = 0.0
        self._longest_s = [0.0, 0.0, 0.0]

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
            return
        generation = info["generation"]
        elapsed_s = time.perf_counter() - self._started_s
        metrics.GC_PAUSE.labels(str(generation)).observe(elapsed_s)
        if elapsed_s > self._longest_s[generation]:
            self._longest_s[generation] = elapsed_s
            metrics.GC_LONGEST_PAUSE.labels(str(generation)).set(elapsed_s)


def settle_started_service() -> None:
    """Called once a service has started: what it holds now is kept out of the collector, full
    passes come rarer, and every pass from now on is timed."""
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, FULL_THRESHOLD)
    if not any(isinstance(callback, PassTimer) for callback in gc.callbacks):
        gc.callbacks.append(PassTimer())
