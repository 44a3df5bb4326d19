"""The worker<->engine-process wire: the worker's non-blocking frames are the engine process's
Connection frames both ways, a message arrives only once all its bytes have, and only messages of
the wire are taken for one."""

from __future__ import annotations

import pickle
import socket
from multiprocessing.connection import Connection
from typing import get_args

import pytest

from tandem.engine.engine import Request
from tandem.engine.sequence import SamplingOptions
from tandem.worker import engine_wire
from tandem.worker.engine_wire import Check, Cut, Died, MessageKind, Result, frame, take_messages


@pytest.fixture
def pair():
    worker, engine = socket.socketpair()
    conn = Connection(engine.detach())
    try:
        yield worker, conn
    finally:
        worker.close()
        conn.close()


def test_every_kind_has_one_message_class():
    classes = [*get_args(engine_wire.ToEngine), *get_args(engine_wire.ToWorker)]
    assert sorted(c.kind.name for c in classes) == sorted(kind.name for kind in MessageKind)


def test_the_engine_process_reads_the_worker_s_frames(pair):
    worker, conn = pair
    check = Check(7, Request("r-1", (1, 2, 3), SamplingOptions(max_tokens=4)))
    worker.sendall(frame(check) + frame(Cut()))
    assert engine_wire.receive(conn) == check
    assert engine_wire.receive(conn) == Cut()


def test_the_worker_takes_the_engine_process_s_messages_only_once_whole(pair):
    worker, conn = pair
    engine_wire.send(conn, Result(7, {"big": b"x" * 100_000}, None))
    engine_wire.send(conn, Died(RuntimeError("boom")))
    worker.settimeout(5)  # every read below has a way out: a recv that waits longer raises
    data = b""
    while len(data) < 100_000:
        data += worker.recv(1 << 16)
    inbox = bytearray()
    taken = []
    for byte in range(len(data)):  # a byte at a time, as a slow socket might hand them over
        inbox += data[byte : byte + 1]
        taken += take_messages(inbox)
        if len(taken) < 1:
            assert len(inbox) == byte + 1, "a part of a frame waits for the rest"
    while len(taken) < 2:
        inbox += worker.recv(1 << 16)
        taken += take_messages(inbox)
    result, died = taken
    assert result == Result(7, {"big": b"x" * 100_000}, None) and not inbox
    assert isinstance(died, Died) and died.exc.args == ("boom",)


def test_what_is_not_a_wire_message_is_refused(pair):
    worker, conn = pair
    data = pickle.dumps(("call", 1, None, False))
    worker.sendall(len(data).to_bytes(4, "big") + data)
    with pytest.raises(TypeError, match="not a message to the engine process"):
        engine_wire.receive(conn)
    with pytest.raises(TypeError, match="not a message to the worker"):
        take_messages(bytearray(len(data).to_bytes(4, "big") + data))
