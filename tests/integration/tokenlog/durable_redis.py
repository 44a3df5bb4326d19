"""A redis-server that keeps its data across a restart (append-only file, fsync on every write),
for the tests that restart Redis under a running reply. The devstack's own redis-server runs
without persistence, so these tests start their own on a port they keep."""

from __future__ import annotations

from pathlib import Path

from tandem.devstack.proc import ChildProcess
from tandem.devstack.servers import READY_TIMEOUT_S, redis_server_binary


class DurableRedis:
    def __init__(self, workdir: Path, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._data = workdir / f"redis-{port}"
        self._data.mkdir(parents=True, exist_ok=True)
        self._child: ChildProcess | None = None

    def start(self) -> None:
        argv = [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self._data)]
        argv += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        self._child = ChildProcess(f"redis-{self.port}", argv)
        self._child.start()
        if self._child.wait_for_line(r"Ready to accept connections", READY_TIMEOUT_S) is None:
            raise RuntimeError(f"redis-server did not start:\n{self._child.recent_output()}")

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop(timeout_s=10)
            self._child = None
