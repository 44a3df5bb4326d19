"""The C++ kernels' build under failure: a build killed half way, a build lock held by another
process. Each starts real Python processes that compile (or wait to compile) the extension into a
cache folder of the test's own, so they sit in the integration tier, not among the unit tests."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest
from helpers import wait_until

from tandem.kernels import cpu_extension


def test_without_a_compiler_the_cpu_falls_back_to_the_torch_path(tmp_path) -> None:
    """A machine with no C++ compiler (CXX a command that fails, an empty cache) still serves: the
    torch path is selected and the reason logged."""
    script = (
        "from tandem.kernels import select_attention, paged_attention_torch\n"
        "assert select_attention('cpu') is paged_attention_torch\n"
        "print('fell back')\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": "false"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "fell back" in done.stdout
    assert "C++ CPU kernels unavailable" in done.stderr


LOAD_SCRIPT = "from tandem.kernels import cpu_extension\nprint('loaded' if cpu_extension.load() else 'torch path')\n"


async def test_a_build_killed_half_way_blocks_no_later_process(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 a process while it compiles the kernels into an empty cache: torch's own lock file
    stays behind (every later build used to wait on it forever); the next process builds and
    loads the kernels."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch_lock = cpu_extension.build_folder() / "lock"
    first = subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:

        async def compiling() -> bool:
            assert first.poll() is None, f"the first build ended before it was killed: {first.stderr.read() if first.stderr else ''}"
            return torch_lock.exists()

        await wait_until(compiling, timeout_s=120)
    finally:
        first.kill()
        first.wait(timeout=30)
    assert torch_lock.exists(), "the killed build's lock file is the leftover this drill needs"
    second = subprocess.run([sys.executable, "-c", LOAD_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout.strip() == "loaded", second.stderr


def test_a_process_that_cannot_get_the_build_lock_in_time_serves_with_the_torch_path(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holds the folder (a build stuck for longer than BUILD_WAIT_S): load gives
    up with the reason logged instead of waiting forever."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = cpu_extension.build_folder()
    folder.mkdir(parents=True)
    script = "from tandem.kernels import cpu_extension\ncpu_extension.BUILD_WAIT_S = 1.0\n" + LOAD_SCRIPT.split("\n", 1)[1]
    with (folder / "build.flock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "torch path", done.stderr
    assert "TimeoutError" in done.stderr
