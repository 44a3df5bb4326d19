"""The other ranks of a tensor-parallel engine (ranks 1..N-1), one process each
(`python -m tandem.worker.engine_rank`), started beside rank 0 by whoever hosts it: the worker, for
an engine process or an engine thread, or `tandem generate`.

They meet rank 0 at a rendezvous file in a folder of their own; each loads its shard of the model,
sizes and allocates its KV cache (in the memfd it is given, which the worker maps, or on its device)
and follows rank 0's steps (engine/runner.py: Runner.follow). One group lives and dies together:
a rank that ends while the group runs is reported to `on_death` (the worker then fails as when its
engine dies, and its replies continue on another worker), and a rank whose parent dies is killed
with it (engine_rank.py sets its parent-death signal)."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.models.tensor_parallel import check_split
from tandem.worker.engine_spec import EngineSpec

log = logging.getLogger(__name__)


class PeerRanks:
    """Ranks 1..N-1 of one engine, started (`start`) before rank 0 joins them."""

    def __init__(self, spec: EngineSpec, processes: list[subprocess.Popen[bytes]], folder: Path) -> None:
        self.spec = spec  # rank 0's: the group's rendezvous filled in
        self._processes = processes
        self._folder = folder
        self._stopping = threading.Event()

    @classmethod
    def start(cls, spec: EngineSpec, kv_fds: Sequence[int | None] = ()) -> PeerRanks:
        """Starts ranks 1..N-1 of `spec`'s engine; `kv_fds[r]`: the memfd rank r allocates its KV
        cache in (an engine process's), none: its own memory."""
        check_split(spec.model, spec.tensor_parallel_size)  # one clear error here, not one traceback a rank
        folder = Path(tempfile.mkdtemp(prefix="tandem-tp-"))
        spec = dataclasses.replace(spec, rendezvous=f"file://{folder / 'rendezvous'}")
        processes: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, spec.tensor_parallel_size):
                kv_fd = kv_fds[rank] if rank < len(kv_fds) else None
                process = subprocess.Popen(
                    # the rank (for `ps`) and this process's pid (the rank dies with it); the spec comes on stdin
                    [sys.executable, "-m", "tandem.worker.engine_rank", str(rank), str(os.getpid())],
                    stdin=subprocess.PIPE,
                    pass_fds=() if kv_fd is None else (kv_fd,),
                )
                assert process.stdin is not None
                process.stdin.write(pickle.dumps((spec, rank, kv_fd)))
                process.stdin.close()
                processes.append(process)
        except BaseException:
            for process in processes:
                process.kill()
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(spec, processes, folder)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def watch(self, on_death: Callable[[int, int], None]) -> None:
        """Calls on_death(rank, exit code) from a thread of its own when a rank ends before `stop`."""
        for rank, process in enumerate(self._processes, start=1):
            threading.Thread(target=self._wait, args=(rank, process, on_death), name=f"tp-rank-{rank}", daemon=True).start()

    def _wait(self, rank: int, process: subprocess.Popen[bytes], on_death: Callable[[int, int], None]) -> None:
        code = process.wait()
        if not self._stopping.is_set():
            log.error("rank %d of this tensor-parallel engine ended (exit code %d): the group ends", rank, code)
            on_death(rank, code)

    def ending(self) -> None:
        """The group is being stopped (rank 0 is about to tell the ranks): their exits are not deaths."""
        self._stopping.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Waits for the ranks to end (rank 0 told them to, or ended: their collectives fail), then
        kills what is left."""
        self._stopping.set()
        for process in self._processes:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("rank process %d did not end within %.0f s of its group's stop; killing it", process.pid, timeout_s)
                process.kill()
                process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)

    def kill(self) -> None:
        """Ends every rank now (the group died elsewhere: rank 0, or one of them)."""
        self._stopping.set()
        for process in self._processes:
            if process.poll() is None:
                process.kill()
        for process in self._processes:
            process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)
