"""The engine process's side of tandem.worker.engine_process: `python -m tandem.worker.engine_core
SOCKET_FD KV_FD`, started by its worker only.

It builds the engine from the spec the worker sends first (its KV cache in the memfd KV_FD, which
the worker maps too), says it is ready, then steps while there is work. A reader thread takes the
worker's messages (engine_wire.py): a check is answered at once (Engine.check reads only the
configuration), a cut cuts the step in progress, calls queue for the engine between two steps.
After every change (a batch of calls, a step, even one that only computed part of a prompt) one
message carries the step's outputs, the fresh stats, how many calls they include, and the KV
events and queue waits recorded since the last (a batch of calls before a step is reported before
it: a prompt computed in one step still shows queued in a heartbeat taken during that step, as
with the engine in a thread); a
call's result follows what the engine recorded before it, so the worker numbers KV events and
answers state requests in one order. A closed socket ends it.

It imports nothing NATS-facing (the spec, the wire, the shared KV cache, the engine calls it
unpickles): the worker's bus stays in the worker."""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection

from tandem.engine.engine import Engine, RequestOutput
from tandem.worker import engine_wire
from tandem.worker.engine_spec import build_engine
from tandem.worker.engine_wire import Call, Change, Check, Cut, Died, Ready, Result, Start, ToWorker
from tandem.worker.shared_kv import shared_kv_cache

log = logging.getLogger(__name__)


class _Worker:
    """The socket to the worker, written from the engine loop and the reader thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: ToWorker) -> None:
        with self._lock:
            engine_wire.send(self._conn, message)

    def answer(self, ticket: int, result: object, exc: BaseException | None) -> None:
        try:
            self.send(Result(ticket, result, exc))
        except (pickle.PicklingError, TypeError, AttributeError) as error:  # nothing was written: pickling comes first
            self.send(Result(ticket, None, RuntimeError(f"{type(exc or result).__name__} could not be sent back: {error}")))

    def report_change(self, engine: Engine, outputs: list[RequestOutput], num_applied: int) -> None:
        self.send(Change(outputs, engine.stats(), num_applied, engine.drain_kv_events(), engine.drain_queue_waits()))


def serve(conn: Connection, kv_fd: int) -> None:
    start = engine_wire.receive(conn)
    if not isinstance(start, Start):
        raise TypeError(f"the engine process's first message is a start, not a {start.kind.name.lower()}")
    logging.basicConfig(level=start.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    worker = _Worker(conn)
    engine = build_engine(start.spec, shared_kv_cache(kv_fd))
    worker.send(Ready(engine.facts(), engine.stats()))
    calls: queue.Queue[Call | None] = queue.Queue()
    threading.Thread(target=_read, args=(conn, engine, worker, calls), name="engine-commands", daemon=True).start()
    num_applied = 0
    while True:
        batch = [calls.get()] if not engine.has_work() else []  # block only with nothing to step
        while True:
            try:
                batch.append(calls.get_nowait())
            except queue.Empty:
                break
        if None in batch:
            engine.close()  # the other ranks of a tensor-parallel engine end too
            return
        for call in batch:
            assert call is not None
            num_applied = call.ticket
            try:
                result, exc = call.fn(engine), None
            except Exception as error:
                result, exc = None, error
                if not call.wants_result:
                    log.warning("engine call failed: %s", error)
            if call.wants_result:  # what the engine recorded so far goes first
                worker.report_change(engine, [], num_applied)
                worker.answer(call.ticket, result, exc)
        if batch and engine.has_work():  # the work just added is in the stats while a step computes it
            worker.report_change(engine, [], num_applied)
            batch = []
        if engine.has_work():  # every step, a prompt's chunk too: the queued tokens count down
            worker.report_change(engine, engine.step(), num_applied)
        elif batch:
            worker.report_change(engine, [], num_applied)


def _read(conn: Connection, engine: Engine, worker: _Worker, calls: queue.Queue[Call | None]) -> None:
    """Until the socket closes; a message it cannot read ends the engine process too (its worker
    then fails, loudly, instead of waiting on a call nobody took)."""
    try:
        while True:
            message = engine_wire.receive(conn)
            if isinstance(message, Cut):  # beside the step in progress: the add before it is queued already
                engine.cut_step()
            elif isinstance(message, Check):
                try:
                    engine.check(message.request)
                except Exception as exc:  # PromptTooLong, EmptyPrompt, TokenIdOutOfRange; anything else goes back too
                    worker.answer(message.ticket, None, exc)
                else:
                    worker.answer(message.ticket, None, None)
            elif isinstance(message, Call):
                calls.put(message)
            else:
                raise TypeError(f"a {message.kind.name.lower()} message after the engine started")
    except (EOFError, OSError):  # the worker closed the socket, or died
        pass
    except Exception:
        log.exception("the engine process cannot read its worker's message; it stops")
    finally:
        calls.put(None)


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
            engine_wire.send(conn, Died(exc))
        except Exception:  # an exception that does not pickle: its words, then
            try:
                engine_wire.send(conn, Died(RuntimeError(f"{type(exc).__name__}: {exc}")))
            except OSError:
                pass
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main(sys.argv[1:])
