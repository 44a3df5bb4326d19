"""The safety check (tandem.safety) in a process of its own, loaded once at a service's start,
with the texts due at once scored in one call: the relay's output check and the chat's input check.

Scoring is CPU-bound Python (profanity-check's took milliseconds a call with scikit-learn's
`predict_proba`, a fraction of that now that tandem.safety applies its arrays itself; a
deployment's own check may take any time): on a thread of the service's own process every call
stalls its event loop. In the relay, checking a busy stream of windows, the loop's lag p99 grew
many times on a thread, less in a child process, on 2 busy cores; in the chat, a message's
routing and tokenizing waited on the GIL while its check ran beside them. In a child process the
service's loop only waits on a pipe. The trained check costs about as much for 32 texts as for one, so a busy service
batches instead of queueing calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from tandem.errors import StartupError
from tandem.safety import TextCheck, load_check

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # spawning the child, importing scikit-learn and loading the model
CALL_TIMEOUT_S = 5.0  # a call not answered by then fails, and its process is replaced
_CHECKS: dict[str, TextCheck | None] = {}  # in the child: the check each spec names, loaded once


def _in_child() -> None:
    """In the child: Ctrl-C to the process group (make run, tandem up) is the service's to handle;
    the service's stop shuts the child down. A service that dies without stopping (kill -9, the
    OOM killer) takes the child with it: the child holds both ends of its call queue's pipe, so it
    would wait on that queue forever, an orphan."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), name="exit-with-parent", daemon=True).start()


def _exit_with(parent_sentinel: int) -> None:
    multiprocessing.connection.wait([parent_sentinel])  # readable once the service is gone
    os._exit(0)


def _check_of(spec: str) -> TextCheck | None:
    if spec not in _CHECKS:
        _CHECKS[spec] = load_check(spec)
    return _CHECKS[spec]


def _name_in_child(spec: str) -> tuple[int, str]:
    check = _check_of(spec)
    return os.getpid(), "" if check is None else check.name


def _score_in_child(spec: str, texts: list[str]) -> tuple[int, list[float]]:
    check = _check_of(spec)
    return os.getpid(), [0.0] * len(texts) if check is None else [float(score) for score in check.score(texts)]


class CheckProcess:
    """The check a spec names (tandem.safety), loaded in a child process; a child that dies is
    started again at the next call, and one that does not answer a call within `call_timeout_s`
    (stopped, stuck) is killed and replaced."""

    def __init__(self, spec: str, name: str, executor: ProcessPoolExecutor, pid: int, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.spec = spec
        self.name = name
        self.call_timeout_s = call_timeout_s
        self._executor = executor
        self._pid: int | None = pid  # the child's, once it answered a call

    @classmethod
    def start(cls, spec: str, setting: str, call_timeout_s: float = CALL_TIMEOUT_S) -> CheckProcess | None:
        """Loads the check in its process now (the service's start waits for it); None for `none`.
        A spec that names nothing loadable is a StartupError naming `setting` (the environment
        variable the spec came from)."""
        executor = _new_executor()
        try:
            pid, name = executor.submit(_name_in_child, spec).result(timeout=START_TIMEOUT_S)
        except ValueError as exc:
            executor.shutdown(wait=False, cancel_futures=True)
            raise StartupError(f"{setting}: {exc}") from None
        if not name:
            executor.shutdown(wait=False, cancel_futures=True)
            return None
        return cls(spec, name, executor, pid, call_timeout_s)

    async def score(self, texts: list[str]) -> list[float]:
        # a new child (after a replacement) may first take its start's time to spawn and load
        timeout_s = self.call_timeout_s if self._pid is not None else START_TIMEOUT_S
        try:
            # the submit itself raises BrokenProcessPool when the pool saw its child die before this call
            call = asyncio.get_running_loop().run_in_executor(self._executor, _score_in_child, self.spec, texts)
            self._pid, scores = await asyncio.wait_for(call, timeout_s)
        except BrokenProcessPool:
            log.error("the %s check's process died; starting it again", self.name)
            self._replace()
            raise
        except TimeoutError:
            log.error("the %s check did not answer within %.1f s; its process is killed and replaced", self.name, timeout_s)
            if self._pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._pid, signal.SIGKILL)
            self._replace()
            raise
        return scores

    async def child_pid(self) -> int:
        """The pid of the process that scores now (for logs, and the drills that stop or kill it)."""
        self._pid = await asyncio.get_running_loop().run_in_executor(self._executor, os.getpid)
        return self._pid

    def _replace(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = _new_executor()
        self._pid = None  # known again at the new child's first answer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _new_executor() -> ProcessPoolExecutor:
    # spawn, not fork: a service runs threads (its event loop's, redis', NATS'), which a fork would copy mid-step
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_in_child)


class BatchScorer:
    """Scores texts with `score_batch`, one call at a time, all that wait at once in one call;
    `observe` (a histogram's) is given each call's seconds."""

    def __init__(
        self, score_batch: Callable[[list[str]], Awaitable[list[float]]], max_batch: int, observe: Callable[[float], None] | None = None
    ) -> None:
        self._score_batch = score_batch
        self._max_batch = max_batch
        self._observe = observe
        self._waiting: list[tuple[str, asyncio.Future[float]]] = []
        self._scoring: asyncio.Task[None] | None = None

    async def score(self, text: str) -> float:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiting.append((text, future))
        if self._scoring is None:
            self._scoring = asyncio.create_task(self._drain(), name="text-check")
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting[: self._max_batch], self._waiting[self._max_batch :]
                started_s = time.perf_counter()
                try:
                    scores = await self._score_batch([text for text, _ in batch])
                except Exception as exc:  # a deployment's check failing fails these checks, not the service
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                if self._observe is not None:
                    self._observe(time.perf_counter() - started_s)
                for (_, future), score in zip(batch, scores, strict=True):
                    if not future.done():
                        future.set_result(float(score))
        finally:
            self._scoring = None
