"""An Engine on a thread of its own, driven from asyncio: a worker's event loop stays free for
NATS and gRPC while the engine steps. Commands go in through a queue; each step's outputs come
back to the loop through a callback."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tandem.engine.engine import Engine, EngineStats, Request, RequestOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request: Request
    accepted: asyncio.Future[None]


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineThread:
    def __init__(
        self,
        build_engine: Callable[[], Engine],
        on_outputs: Callable[[list[RequestOutput]], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._build_engine = build_engine
        self._on_outputs = on_outputs
        self._loop = loop
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._is_ready = threading.Event()
        self._failure: BaseException | None = None
        self.engine: Engine | None = None
        self.latest_stats: EngineStats | None = None

    @property
    def is_ready(self) -> bool:
        return self._is_ready.is_set() and self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    async def add(self, request: Request) -> None:
        """Queues a request; raises what Engine.add raises (PromptTooLong, ...)."""
        accepted = self._loop.create_future()
        self._commands.put(_Add(request, accepted))
        await accepted

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self.engine = self._build_engine()
        except BaseException as exc:  # noqa: BLE001 - reported by readiness and the log
            self._failure = exc
            log.exception("the engine failed to start")
            return
        self.latest_stats = self.engine.stats()
        self._is_ready.set()
        while True:
            # Block for a command only when there is nothing to step.
            commands = [self._commands.get()] if not self.engine.has_work() else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            if None in commands:
                return
            for command in commands:
                self._apply(command)
            if self.engine.has_work():
                outputs = self.engine.step()
                self.latest_stats = self.engine.stats()
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)

    def _apply(self, command: _Add | _Abort | None) -> None:
        assert self.engine is not None and command is not None
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)
            return
        try:
            self.engine.add(command.request)
        except ValueError as exc:
            self._loop.call_soon_threadsafe(_settle, command.accepted, exc)
        else:
            self._loop.call_soon_threadsafe(_settle, command.accepted, None)


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
