"""set_progress_timeout: ucxx's progress thread starts with the wait it names instead of 1 ms."""

from __future__ import annotations

import asyncio
import gc

import pytest

pytest.importorskip("ucxx")
from ucxx._lib_async import continuous_ucx_progress as progress

from tandem.kvtransfer.progress import set_progress_timeout


class _RecordingWorker:
    """What ThreadMode asks of a UCXX worker, recorded (no UCX is started)."""

    def __init__(self) -> None:
        self.started: list[dict] = []
        self.stopped = 0

    def set_progress_thread_start_callback(self, callback) -> None:
        self.callback = callback

    def start_progress_thread(self, **kwargs) -> None:
        self.started.append(kwargs)

    def stop_progress_thread(self) -> None:
        self.stopped += 1


def test_the_progress_thread_waits_the_timeout_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress.ThreadMode, "__init__", progress.ThreadMode.__init__)  # restored after the test
    assert set_progress_timeout(37)
    worker = _RecordingWorker()
    loop = asyncio.new_event_loop()
    mode = progress.ThreadMode(worker, loop)
    assert worker.started == [{"polling_mode": False, "epoll_timeout": 37}]
    assert worker.callback is progress._create_context
    loop.close()
    del mode, loop  # (ucxx's close hook keeps the mode alive with its loop)
    gc.collect()
    assert worker.stopped == 1  # its finalizer stops the thread, as ucxx's own does


def test_a_timeout_under_a_millisecond_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        set_progress_timeout(0)
