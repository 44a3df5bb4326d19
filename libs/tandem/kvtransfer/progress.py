"""How often an idle UCXX worker looks for work.

ucxx's default progress mode runs a thread per process that waits on the UCX worker's event file
descriptor for at most 1 ms before looking again: an idle worker process wakes 1,000 times a second
(CPU that adds up, with three such processes beside every engine on a 2-vCPU machine). UCX wakes that thread through the descriptor when an event arrives, so a longer wait
only matters for an event that does not signal it; set_progress_timeout lengthens it. ucxx takes
the value as a fixed argument of its private ThreadMode, so this wraps that class's constructor;
where ucxx's layout differs, the default stays and a warning says so.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

log = logging.getLogger(__name__)


def set_progress_timeout(timeout_ms: int) -> bool:
    """The progress threads started after this call wait up to `timeout_ms` for an event (ucxx's
    own: 1 ms). Call it before ucxx starts (its first listener or endpoint). True when applied."""
    if timeout_ms < 1:
        raise ValueError(f"timeout_ms must be at least 1, got {timeout_ms}")
    try:
        from ucxx._lib_async import continuous_ucx_progress as progress
    except ImportError as error:
        log.warning("ucxx's progress thread keeps its 1 ms wait: %s", error)
        return False
    thread_mode, base, on_start = (getattr(progress, name, None) for name in ("ThreadMode", "ProgressTask", "_create_context"))
    if thread_mode is None or base is None or on_start is None:
        log.warning("ucxx's progress thread keeps its 1 ms wait: this ucxx has no ThreadMode, ProgressTask or _create_context")
        return False

    def start(self: Any, worker: Any, event_loop: Any, polling_mode: bool = False) -> None:
        base.__init__(self, worker, event_loop)
        worker.set_progress_thread_start_callback(on_start)
        worker.start_progress_thread(polling_mode=polling_mode, epoll_timeout=timeout_ms)
        weakref.finalize(self, worker.stop_progress_thread)

    thread_mode.__init__ = start
    return True
