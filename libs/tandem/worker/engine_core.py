"""The engine process's side of tandem.worker.engine_process: `python -m tandem.worker.engine_core
SOCKET_FD KV_FD`, started by its worker only.

It builds the engine from the spec the worker sends first (its KV cache in the memfd KV_FD, which
the worker maps too), says "ready", then steps while there is work. A reader thread takes the
worker's messages: `check` is answered at once (Engine.check reads only the configuration), calls
queue for the engine between two steps. After every change (a batch of calls, a step) one message
carries the step's outputs, the fresh stats, how many calls they include, and the KV events and
queue waits recorded since the last; a call's result follows what the engine recorded before it, so
the worker numbers KV events and answers state requests in one order. A closed socket ends it."""

from __future__ import annotations

import logging
import math
import mmap
import os
import pickle
import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from tandem.engine.engine import Engine, KvCacheAllocator

log = logging.getLogger(__name__)


def send(conn: Connection, message: tuple[Any, ...]) -> None:
    """One message, pickled whole before a byte is written (a result that does not pickle leaves
    the stream intact). Plain pickle, not Connection.send's: torch makes that one share a
    tensor's memory through a file descriptor instead of copying it."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class _Worker:
    """The socket to the worker, written from the engine loop and the reader thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            send(self._conn, message)

    def answer(self, ticket: int, result: object, exc: BaseException | None) -> None:
        try:
            self.send(("result", ticket, result, exc))
        except (pickle.PicklingError, TypeError, AttributeError) as error:  # nothing was written: pickling comes first
            self.send(("result", ticket, None, RuntimeError(f"{type(exc or result).__name__} could not be sent back: {error}")))


def shared_kv_cache(fd: int) -> KvCacheAllocator:
    """An allocator (Engine's allocate_kv_cache) of a zeroed CPU KV cache in the memfd `fd`."""

    def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            raise ValueError(f"an engine process shares its KV cache on a CPU only, not on {device}")
        num_bytes = math.prod(shape) * dtype.itemsize
        # A memfd takes any size and faults pages in as they are touched; refuse what torch.zeros's
        # allocation would (more than the memory and swap there are) now, not at a later step.
        if num_bytes > (limit := _memory_bytes()):
            raise MemoryError(
                f"a KV cache of {num_bytes / 2**30:.1f} GiB does not fit in this machine's {limit / 2**30:.1f} GiB of memory and swap"
            )
        os.ftruncate(fd, num_bytes)  # a memfd grows zero-filled
        return map_kv_cache(fd, shape, dtype)

    return allocate


def map_kv_cache(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The memfd `fd` (sized already) as a KV cache tensor, every page mapped now (MAP_POPULATE):
    the first mapping allocates the cache's memory at start, as a GPU engine does, and the other
    process's maps what is there. Faulted in page by page instead, a handoff's 46 MB (a
    2,000-token prompt) cost the worker and its engine process tens of thousands of page faults on
    the way to the reply's second token (270-290 ms after the first, against 65 with one process)."""
    numel = math.prod(shape)
    buffer = mmap.mmap(fd, numel * dtype.itemsize, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # the tensor keeps the mapping


def _memory_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    return sum(int(fields.get(name, "0 kB").split()[0]) * 1024 for name in ("MemTotal", "SwapTotal"))


def serve(conn: Connection, kv_fd: int) -> None:
    from tandem.worker.host import build_engine  # the worker's own builder, torch threads and all

    spec, log_level = receive(conn)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    worker = _Worker(conn)
    engine = build_engine(spec, shared_kv_cache(kv_fd))
    worker.send(("ready", engine.facts(), engine.stats()))
    commands: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
    threading.Thread(target=_read, args=(conn, engine, worker, commands), name="engine-commands", daemon=True).start()
    num_applied = 0
    while True:
        batch = [commands.get()] if not engine.has_work() else []  # block only with nothing to step
        while True:
            try:
                batch.append(commands.get_nowait())
            except queue.Empty:
                break
        if None in batch:
            return
        for command in batch:
            assert command is not None
            _, ticket, fn, wants_result = command
            num_applied = ticket
            try:
                result, exc = fn(engine), None
            except Exception as error:
                result, exc = None, error
                if not wants_result:
                    log.warning("engine call failed: %s", error)
            if wants_result:  # what the engine recorded so far goes first
                worker.send(("change", [], engine.stats(), num_applied, engine.drain_kv_events(), engine.drain_queue_waits()))
                worker.answer(ticket, result, exc)
        outputs = engine.step() if engine.has_work() else []
        if batch or outputs:
            worker.send(("change", outputs, engine.stats(), num_applied, engine.drain_kv_events(), engine.drain_queue_waits()))


def _read(conn: Connection, engine: Engine, worker: _Worker, commands: queue.Queue[tuple[Any, ...] | None]) -> None:
    """Until the socket closes; a message it cannot read ends the engine process too (its worker
    then fails, loudly, instead of waiting on a call nobody took)."""
    try:
        while True:
            message = receive(conn)
            if message[0] == "cut":  # beside the step in progress: the add before it is queued already
                engine.cut_step()
            elif message[0] == "check":
                _, ticket, request, _ = message
                try:
                    engine.check(request)
                except Exception as exc:  # PromptTooLong, EmptyPrompt, TokenIdOutOfRange; anything else goes back too
                    worker.answer(ticket, None, exc)
                else:
                    worker.answer(ticket, None, None)
            else:
                commands.put(message)
    except (EOFError, OSError):  # the worker closed the socket, or died
        pass
    except Exception:
        log.exception("the engine process cannot read its worker's message; it stops")
    finally:
        commands.put(None)


def main(argv: list[str]) -> None:
    # The worker drains on SIGTERM and SIGINT (they may reach its whole process group): this
    # process serves that drain and ends when the worker closes the socket.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn, kv_fd = Connection(int(argv[0])), int(argv[1])
    try:
        serve(conn, kv_fd)
    except BaseException as exc:
        log.exception("the engine process died")
        try:
            send(conn, ("died", exc))
        except Exception:  # an exception that does not pickle: its words, then
            try:
                send(conn, ("died", RuntimeError(f"{type(exc).__name__}: {exc}")))
            except OSError:
                pass
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main(sys.argv[1:])
