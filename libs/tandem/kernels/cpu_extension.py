"""The C++ CPU kernels (cpu/, a file an op or shared concept), compiled on this machine once and
loaded from the user's cache: the `torch.ops.tandem.*` ops that cpu/register.cpp registers
(`paged_decode`, `write_kv`, `rms_norm`, `rotary_qk`, `packed_mm` and the others).

Built with torch's extension mechanism (torch.utils.cpp_extension, ninja and the system's C++
compiler) for this CPU's instruction set (-march=native), at install time (`make`, through
`cpu_extension.main`) or else at the first load. The folder is
`$XDG_CACHE_HOME/tandem/kernels/cpu_kernels-<key>` (`~/.cache/...`), the key a hash of every
source and header in cpu/, the flags, torch's and Python's versions and the CPU's model and flags,
so a changed file, a new torch or another machine sharing the home folder builds its own copy.
Processes starting together build once: each loads or builds under an flock on the folder
(_build_lock), so none loads a library still being written, and a build killed half-way (kill -9)
blocks nobody: the next process builds afresh.

A machine without a C++ compiler still serves: `load()` returns False with the reason logged
once, and select_attention falls back to the torch path. OpenMP comes from torch's own runtime
(the kernels are compiled with -fopenmp but not linked against a second libgomp), so they use
the threads torch.set_num_threads gives.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAME = "tandem_cpu_paged"
# The kernels' sources (*.cpp, each compiled on its own) and the headers they share (*.h).
SOURCE_DIR = Path(__file__).with_name("cpu")
CFLAGS = ("-O3", "-march=native", "-fopenmp")
# How long a process waits for another's build of the same kernels (well above what a build takes
# on two cores; ninja compiles the files side by side, so less on more).
BUILD_WAIT_S = 300.0


def _cpu_identity() -> str:
    """The CPU's model name and flags (Linux), else the platform's processor string."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return platform.processor()
    return "\n".join(line for line in first.splitlines() if line.startswith(("model name", "flags")))


def _kernel_files() -> list[Path]:
    """Every source and header in SOURCE_DIR, in name order."""
    return sorted(path for path in SOURCE_DIR.iterdir() if path.suffix in (".cpp", ".h"))


def build_folder(root: Path | None = None) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    files = tuple(f"{path.name}\0{path.read_bytes().hex()}" for path in _kernel_files())
    parts = (*files, " ".join(CFLAGS), torch.__version__, sys.version, _cpu_identity())
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return (root or Path(base) / "tandem" / "kernels") / f"cpu_kernels-{key}"


def is_loaded() -> bool:
    return hasattr(torch.ops.tandem, "paged_decode")


@functools.cache
def load() -> bool:
    """Loads the kernels, building them first when the cache has none; False (and the reason
    logged) when they cannot be built or loaded here."""
    if is_loaded():
        return True
    try:
        _load(build_folder())
    except (OSError, RuntimeError, subprocess.SubprocessError, ImportError, TimeoutError) as error:
        log.warning("C++ CPU kernels unavailable (%s: %s); using the torch attention path", type(error).__name__, error)
        return False
    return is_loaded()


def _load(folder: Path) -> None:
    library = folder / f"{NAME}.so"
    with _build_lock(folder):
        if not library.is_file():
            _build(folder)
            return
        try:
            torch.ops.load_library(str(library))
        except OSError as error:  # a copy cut short (a build killed while linking): build it again
            log.warning("rebuilding the C++ CPU kernels: %s", error)
            library.unlink()
            _build(folder)


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """The folder to one process at a time, for at most BUILD_WAIT_S of waiting. An flock, which
    the kernel releases when its holder dies; torch's own lock file (`lock`) is not, and a build
    killed half-way left it behind for every later build to wait on forever. Holding this one,
    no build runs, so a `lock` found is such a leftover and is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "build.flock").open("w") as handle:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building the kernels in {folder} for over {BUILD_WAIT_S:.0f} s") from None
                time.sleep(0.2)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(folder: Path) -> None:
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    # ninja comes from its PyPI wheel, whose binary is not on PATH when the venv is not activated.
    import ninja

    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its notes on the compiler's ABI and version
            sources = [str(path) for path in _kernel_files() if path.suffix == ".cpp"]  # each finds its headers beside it
            cpp_extension.load(NAME, sources, extra_cflags=list(CFLAGS), build_directory=str(folder), is_python_module=False)
    finally:
        os.environ["PATH"] = path


def main() -> None:
    """Builds (or finds) the kernels and says which: `make` runs it at install."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    available = load()
    print(f"C++ CPU kernels: {'built and loaded from ' + str(build_folder()) if available else 'unavailable (the torch path serves)'}")


if __name__ == "__main__":
    main()
