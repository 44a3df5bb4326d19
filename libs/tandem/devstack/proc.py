"""Child processes that Tandem starts itself: embedded servers, and services under `tandem up`.

A child's output is pumped line by line to a callback (the launcher prefixes it) and kept so a
caller can wait for a readiness line. Children die with their parent, even on SIGKILL.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGTERM when the parent dies.
    # Strictly, when the parent's forking *thread* ends: `tandem up` starts children from the
    # loop's executor threads, which live as long as the launcher (they are never retired).
    if _libc is not None and hasattr(_libc, "prctl"):
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_handed_out: set[int] = set()  # ports free_port gave this process: callers bind them later
_LOWEST_PORT = 10000


def _lowest_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(host: str = "127.0.0.1", num_tries: int = 100) -> int:
    """A TCP port that was free a moment ago (the caller binds it soon after), never one this
    process was given before: a stack plans all its members' ports before any of them binds.
    Below the kernel's ephemeral range where it can tell: a port from there can be taken as the
    local end of some process's outgoing connection before its server binds it (a chat instance
    then fails to start with "port in use"), or when a server restarts on the same port."""
    lowest_ephemeral = _lowest_ephemeral_port()
    for _ in range(num_tries):
        if lowest_ephemeral > _LOWEST_PORT + 1000:
            port = random.randrange(_LOWEST_PORT, lowest_ephemeral)
            if port in _handed_out or not _can_bind(host, port):
                continue
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"no free port on {host} that this process was not given already, in {num_tries} tries")


def free_ports(num_ports: int, host: str = "127.0.0.1", num_tries: int = 100) -> int:
    """The first of `num_ports` consecutive TCP ports that were all free a moment ago (a stack's
    chat instances take consecutive ports)."""
    for _ in range(num_tries):
        first = free_port(host)
        if first + num_ports - 1 <= 65535 and all(_can_bind(host, port) for port in range(first + 1, first + num_ports)):
            return first
    raise OSError(f"no {num_ports} consecutive free ports on {host} in {num_tries} tries")


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class ChildProcess:
    """One child process with its output pumped to `on_line` and remembered for `wait_for_line`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_line: Callable[[str, str], None] | None = None,
        num_lines_kept: int = 200,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self._env = env
        self._cwd = cwd
        self._on_line = on_line
        self._lines: collections.deque[str] = collections.deque(maxlen=num_lines_kept)
        self._num_lines_seen = 0
        self._is_output_closed = False
        self._changed = threading.Condition()
        self._process: subprocess.Popen[str] | None = None
        self._pump: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def process(self) -> subprocess.Popen[str]:
        if self._process is None:
            raise RuntimeError(f"{self.name} was never started")
        return self._process

    def start(self) -> None:
        with self._changed:
            self._lines.clear()
            self._num_lines_seen = 0
            self._is_output_closed = False
        self._process = subprocess.Popen(
            self.argv,
            env=self._env,
            cwd=self._cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only; it stops us in order
            preexec_fn=_die_with_parent,
        )
        self._pump = threading.Thread(target=self._pump_output, name=f"pump:{self.name}", daemon=True)
        self._pump.start()

    def _pump_output(self) -> None:
        stream = self.process.stdout
        assert stream is not None
        for raw in stream:
            line = raw.rstrip("\n")
            if self._on_line is not None:
                self._on_line(self.name, line)
            with self._changed:
                self._lines.append(line)
                self._num_lines_seen += 1
                self._changed.notify_all()
        stream.close()
        with self._changed:
            self._is_output_closed = True
            self._changed.notify_all()

    @property
    def num_lines(self) -> int:
        """Output lines seen since the last start; pass it as `since` to wait for what comes next."""
        with self._changed:
            return self._num_lines_seen

    def wait_for_line(self, pattern: str, timeout_s: float, since: int = 0) -> re.Match[str] | None:
        """The first output line from number `since` on (seen so far or later) that matches
        `pattern`; None if the output ends or `timeout_s` passes first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        next_index = since
        with self._changed:
            while True:
                first_kept = self._num_lines_seen - len(self._lines)
                for index in range(max(next_index, first_kept), self._num_lines_seen):
                    if match := regex.search(self._lines[index - first_kept]):
                        return match
                next_index = self._num_lines_seen
                remaining_s = deadline - time.monotonic()
                if self._is_output_closed or remaining_s <= 0:
                    return None
                self._changed.wait(remaining_s)

    def recent_output(self, num_lines: int = 15) -> str:
        with self._changed:
            return "\n".join(list(self._lines)[-num_lines:])

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self) -> int:
        return self.process.wait()

    async def wait_async(self) -> int:
        """Waits for the exit without a thread: the loop watches a pidfd (Linux 5.3+)."""
        process = self.process
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(process.pid)
        exited = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(pidfd, on_exit)
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return process.wait()

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status."""
        process = self.process
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._pump is not None:
            self._pump.join(timeout=2)
        return process.returncode
