"""An Engine in a process of its own (engine_core.py), driven from the worker's asyncio loop over a
socket pair: the CPU worker's default (TANDEM_ENGINE_PROCESS). In one process the engine thread and
the event loop share one GIL, and every token the loop publishes delays the engine's next kernel
launch; here the engine never waits for the loop, as in vLLM's engine core and SGLang's scheduler
process.

The surface is EngineThread's: `call` and `post` run a function on the engine between two steps
(in order, by ticket); each step's outputs, the fresh stats and what the engine recorded (its KV
events, its queue waits) come back as one message to `on_change` and `on_outputs`; `check` answers
at once, beside a step in progress. The messages are engine_wire's, on an EngineChannel; the
functions and their arguments travel pickled, so they are module-level functions (engine_calls.py,
functools.partial of them), not closures.

The KV cache lives in a memfd that both processes map (shared_kv.py), so the worker reads and
writes a handoff's blocks (`block_view`) without a copy through the socket. The engine process ignores SIGINT and
SIGTERM (the worker drains on them, and the engine must serve the drain) and ends when its socket
closes: at `stop`, or when the worker dies however it dies. Its death (a crash, kill -9, a failed
load) is the worker's `on_death`, as the engine thread's is."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tandem.engine.block_pool import KvEvent
from tandem.engine.engine import Engine, EngineFacts, EngineStats, QueueWait, Request, RequestOutput
from tandem.worker.engine_channel import EngineChannel
from tandem.worker.engine_ranks import PeerRanks
from tandem.worker.engine_spec import EngineSpec
from tandem.worker.engine_wire import Call, Change, Check, Cut, Died, Ready, Result, Start, ToEngine, ToWorker
from tandem.worker.shared_kv import create_kv_memfd, map_kv_cache
from tandem.worker.thread import EngineDead, EngineDriver

log = logging.getLogger(__name__)

T = TypeVar("T")
OnChange = Callable[[EngineStats, list[KvEvent], list[QueueWait]], None]


class EngineProcess(EngineDriver):
    def __init__(
        self,
        spec: EngineSpec,
        on_outputs: Callable[[list[RequestOutput]], None],
        loop: asyncio.AbstractEventLoop,
        on_change: OnChange = lambda stats, events, waits: None,
        on_death: Callable[[BaseException], None] = lambda exc: None,
        log_level: str = "INFO",
    ) -> None:
        """`spec`: what the engine process builds its engine from (engine_spec.build_engine)."""
        super().__init__()
        self._spec = spec
        self._on_outputs = on_outputs
        self._loop = loop
        self._on_change = on_change
        self._on_death = on_death
        self._log_level = log_level
        self._num_posted = 0
        self._facts: EngineFacts | None = None
        self._kv_caches: list[torch.Tensor] = []  # each rank's, once loaded
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._channel: EngineChannel | None = None
        self._kv_fds: list[int] = []  # each rank's memfd
        self._child: subprocess.Popen[bytes] | None = None
        self._peers: PeerRanks | None = None  # ranks 1..N-1 of a tensor-parallel engine

    @property
    def is_ready(self) -> bool:
        return self._facts is not None and self._death is None

    @property
    def pid(self) -> int | None:
        """The engine process's, once started."""
        return None if self._child is None else self._child.pid

    @property
    def exit_code(self) -> int | None:
        """The engine process's, once it has ended (and been waited for); None before."""
        return None if self._child is None else self._child.returncode

    @property
    def facts(self) -> EngineFacts:
        if self._facts is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._facts

    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One block of each rank's shared KV cache (rank 0's first), as Engine.block_view gives it
        in that rank's process."""
        if not self._kv_caches:
            raise RuntimeError("the engine is not loaded yet")
        return [kv_cache[block_id] for kv_cache in self._kv_caches]

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        self._kv_fds = [create_kv_memfd() for _ in range(self._spec.tensor_parallel_size)]
        spec = self._spec
        if spec.tensor_parallel_size > 1:
            self._peers = PeerRanks.start(spec, self._kv_fds)
            spec = self._peers.spec
            self._peers.watch(self._on_rank_death)
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "tandem.worker.engine_core", str(theirs.fileno()), str(self._kv_fds[0])],
                pass_fds=(theirs.fileno(), self._kv_fds[0]),
            )
        finally:
            theirs.close()
        self._channel = EngineChannel(ours, self._loop, self._handle, self._on_closed)
        self._send(Start(spec, self._log_level))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Runs fn(engine) in the engine process before its next step; returns or raises what fn does."""
        if self._death is not None:
            raise EngineDead("the engine process has died") from self._death
        return await self._ask(Call(self._next_ticket(), fn, wants_result=True))

    def post(self, fn: Callable[[Engine], object]) -> int:
        """Like `call`, without waiting (an abort, a release); returns its ticket."""
        ticket = self._next_ticket()
        if self._death is None:
            self._send(Call(ticket, fn, wants_result=False))
        return ticket

    def cut_step(self) -> None:
        """Engine.cut_step in the engine process, beside the step in progress (after posting a
        paid request's add: the socket keeps their order)."""
        if self._death is None:
            self._send(Cut())

    async def check(self, request: Request) -> None:
        """Engine.check in the engine process, answered beside the step in progress."""
        if self._death is not None:
            raise EngineDead("the engine process has died") from self._death
        await self._ask(Check(self._next_ticket(), request))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Closes the socket (the engine process ends after its step in progress) and waits for it."""
        if self._peers is not None:
            self._peers.ending()  # rank 0 stops them as it ends: not a death
        if self._channel is not None:
            self._channel.close()
        for fd in self._kv_fds:
            os.close(fd)
        self._kv_fds = []
        if self._child is not None:
            try:
                self._child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not end within %.0f s of its stop; killing it", timeout_s)
                self._child.kill()
                self._child.wait()
        if self._peers is not None:
            self._peers.stop(timeout_s)

    # -- internals ------------------------------------------------------------------------------

    def _next_ticket(self) -> int:
        self._num_posted += 1
        return self._num_posted

    async def _ask(self, message: Call | Check) -> Any:
        """Sends `message` and waits for the result with its ticket."""
        done = self._loop.create_future()
        self._pending[message.ticket] = done
        self._send(message)
        return await done

    def _send(self, message: ToEngine) -> None:
        assert self._channel is not None
        try:
            self._channel.send(message)
        except OSError as exc:  # the engine process is gone; its EOF tells the reader too
            self._die(EngineDead(f"the engine process is gone: {type(exc).__name__}"))

    def _on_closed(self, exc: BaseException) -> None:
        code = self._child.poll() if self._child is not None else None
        self._die(EngineDead(f"the engine process ended ({type(exc).__name__}, exit code {code})"))

    def _handle(self, message: ToWorker) -> None:
        if isinstance(message, Change):
            self._snapshot = (message.stats, message.num_applied)
            self._on_change(message.stats, message.kv_events, message.queue_waits)
            if message.outputs:
                self._on_outputs(message.outputs)
        elif isinstance(message, Result):
            done = self._pending.pop(message.ticket, None)
            if done is not None and not done.done():
                if message.exc is None:
                    done.set_result(message.result)
                else:
                    done.set_exception(message.exc)
        elif isinstance(message, Ready):
            self._kv_caches = [map_kv_cache(fd, message.facts.kv_cache_shape, message.facts.kv_dtype) for fd in self._kv_fds]
            self._facts = message.facts
            self._snapshot = (message.stats, 0)
        elif isinstance(message, Died):
            self._die(message.exc)

    def _on_rank_death(self, rank: int, code: int) -> None:
        """From a rank's watcher thread: one rank's death is the whole engine's."""
        self._loop.call_soon_threadsafe(self._die, EngineDead(f"rank {rank} of the tensor-parallel engine ended (exit code {code})"))

    def _die(self, exc: BaseException) -> None:
        if self._death is not None:
            return
        self._death = exc
        if self._peers is not None:  # the group lives and dies together
            if self._child is not None and self._child.poll() is None:
                self._child.kill()
            self._peers.kill()
        pending, self._pending = self._pending, {}
        for done in pending.values():
            if not done.done():
                dead = EngineDead("the engine process has died")
                dead.__cause__ = exc
                done.set_exception(dead)
        self._on_death(exc)
