"""An Engine on a thread of its own, driven from asyncio: a worker's event loop stays free for
NATS, gRPC and UCX while the engine steps. Every touch of the engine (add, abort, reserve,
import, release) runs on its thread between two steps, through `call`; each step's outputs come
back to the loop through a callback. After every change (a batch of calls, a step) the thread
refreshes `latest_stats` and runs `after_change` on itself: the place to drain what the engine
recorded, such as its KV events, while nothing else touches it. Every call and post gets a
ticket (1, 2, ...; they run in that order) and `num_applied` says how many had run when
`latest_stats` was taken, so the loop knows which of its changes those stats include.

An exception that escapes the engine (at load or in a step) ends the thread: `on_death` tells the
loop, every call waiting or made later raises EngineDead, and the worker must stop serving (its
engine's state is unknown)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.engine.engine import Engine, EngineFacts, EngineStats, Request, RequestOutput

log = logging.getLogger(__name__)


T = TypeVar("T")


class EngineDead(RuntimeError):
    """The engine thread ended on an exception; nothing more runs on it."""


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Engine], Any]
    done: asyncio.Future[Any] | None  # None: nobody waits for the result


class EngineDriver:
    """What the loop reads of an engine it drives on a thread (EngineThread) or in a process
    (engine_process.EngineProcess): the latest stats, with the tickets they include, and its death."""

    def __init__(self) -> None:
        self._death: BaseException | None = None
        self._snapshot: tuple[EngineStats, int] | None = None  # latest stats, and how many calls had run then

    @property
    def latest_stats(self) -> EngineStats | None:
        snapshot = self._snapshot
        return None if snapshot is None else snapshot[0]

    @property
    def snapshot(self) -> tuple[EngineStats, int] | None:
        """The latest stats and the number of calls and posts (tickets) they include; None until loaded."""
        return self._snapshot

    @property
    def death(self) -> BaseException | None:
        """What ended the engine, or None while it lives (or stopped cleanly)."""
        return self._death


class EngineThread(EngineDriver):
    def __init__(
        self,
        build_engine: Callable[[], Engine],
        on_outputs: Callable[[list[RequestOutput]], None],
        loop: asyncio.AbstractEventLoop,
        after_change: Callable[[Engine], None] = lambda engine: None,
        on_death: Callable[[BaseException], None] = lambda exc: None,
    ) -> None:
        super().__init__()
        self._build_engine = build_engine
        self._on_outputs = on_outputs
        self._loop = loop
        self._after_change = after_change
        self._on_death = on_death
        self._commands: queue.Queue[_Call | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._is_ready = threading.Event()
        self._engine: Engine | None = None
        self._facts: EngineFacts | None = None
        self._num_posted = 0  # tickets handed out, on the loop
        self._num_applied = 0  # calls run, on the engine thread

    @property
    def is_ready(self) -> bool:
        return self._is_ready.is_set() and self._death is None and self._thread.is_alive()

    @property
    def _loaded(self) -> Engine:
        """The engine itself, for what the loop may read while it steps (its facts, views of blocks
        no step touches, its configuration's checks); every change goes through `call` or `post`."""
        if self._engine is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._engine

    @property
    def facts(self) -> EngineFacts:
        if self._facts is None:
            self._facts = self._loaded.facts()
        return self._facts

    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One block's K and V (Engine.block_view): a view no step touches while its block is held
        for a handoff. The other ranks of a tensor-parallel engine keep theirs on their own devices,
        out of this process's reach: such an engine hands off no KV."""
        engine = self._loaded
        if engine.facts().tensor_parallel_size > 1:
            raise RuntimeError(
                "a tensor-parallel engine on its worker's thread hands off no KV: its other ranks' blocks are on their devices"
            )
        return [engine.block_view(block_id)]

    async def check(self, request: Request) -> None:
        """Engine.check, which reads only the configuration: answered at once, beside a step."""
        self._loaded.check(request)

    def start(self) -> None:
        self._thread.start()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Runs fn(engine) on the engine thread before its next step; returns or raises what fn does."""
        if self._death is not None:
            raise EngineDead("the engine thread has died") from self._death
        done = self._loop.create_future()
        self._num_posted += 1
        self._commands.put(_Call(fn, done))
        if self._death is not None:  # it died while we queued: nobody will take the call
            self._fail_pending()
        return await done

    def post(self, fn: Callable[[Engine], object]) -> int:
        """Like `call`, without waiting (an abort, a release); returns its ticket."""
        self._num_posted += 1
        self._commands.put(_Call(fn, None))
        return self._num_posted

    def cut_step(self) -> None:
        """Engine.cut_step, now, beside the step in progress (after posting a paid request's add)."""
        if self._engine is not None:
            self._engine.cut_step()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            engine = self._engine = self._build_engine()
        except BaseException as exc:
            log.exception("the engine failed to start")
            self._die(exc)
            return
        self._snapshot = (engine.stats(), self._num_applied)
        self._is_ready.set()
        try:
            self._loop_until_stopped(engine)
        except BaseException as exc:
            log.exception("the engine thread died")
            self._die(exc)
            return
        engine.close()  # a tensor-parallel engine's other ranks end too

    def _die(self, exc: BaseException) -> None:
        self._death = exc
        self._fail_pending()
        self._loop.call_soon_threadsafe(self._on_death, exc)

    def _fail_pending(self) -> None:
        """Every queued call raises EngineDead (thread-safe: from the dead thread or the loop)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None and command.done is not None:
                dead = EngineDead("the engine thread has died")
                dead.__cause__ = self._death
                self._loop.call_soon_threadsafe(_settle, command.done, None, dead)

    def _loop_until_stopped(self, engine: Engine) -> None:
        while True:
            # Block for a command only when there is nothing to step.
            commands = [self._commands.get()] if not engine.has_work() else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if None in commands:
                return
            for command in commands:
                self._apply(engine, command)
            if commands:  # a release or reservation changes the blocks without a step
                self._changed(engine)
            if engine.has_work():
                outputs = engine.step()
                self._changed(engine)
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)

    def _changed(self, engine: Engine) -> None:
        self._snapshot = (engine.stats(), self._num_applied)
        try:
            self._after_change(engine)
        except Exception:
            log.exception("the engine's after-change hook failed")

    def _apply(self, engine: Engine, command: _Call | None) -> None:
        assert command is not None  # the stop command ends the loop before it is applied
        self._num_applied += 1
        try:
            result = command.fn(engine)
        except Exception as exc:
            if command.done is None:
                log.warning("engine call failed: %s", exc)
            else:
                self._loop.call_soon_threadsafe(_settle, command.done, None, exc)
        else:
            if command.done is not None:
                self._loop.call_soon_threadsafe(_settle, command.done, result, None)


def _settle(future: asyncio.Future[Any], result: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)
