"""The C++ CPU kernels (cpu_paged.cpp), compiled on this machine once and loaded from the user's
cache: `torch.ops.tandem.paged_decode`, `write_kv`, `rms_norm` and `rotary_qk`.

Built with torch's extension mechanism (torch.utils.cpp_extension, ninja and the system's C++
compiler) for this CPU's instruction set (-march=native), at install time (`make`, through
`cpu_extension.main`) or else at the first load. The folder is
`$XDG_CACHE_HOME/tandem/kernels/cpu_paged-<key>` (`~/.cache/...`), the key a hash of the
source, the flags, torch's and Python's versions and the CPU's model and flags, so a changed
source, a new torch or another machine sharing the home folder builds its own copy. Processes
starting together build once: torch's build holds a lock file in the folder, and a process that
finds it goes through the build too (waiting for the lock) instead of loading a library being
written.

A machine without a C++ compiler still serves: `load()` returns False with the reason logged
once, and select_attention falls back to the torch path. OpenMP comes from torch's own runtime
(the kernels are compiled with -fopenmp but not linked against a second libgomp), so they use
the threads torch.set_num_threads gives.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAME = "tandem_cpu_paged"
SOURCE = Path(__file__).with_name("cpu_paged.cpp")
CFLAGS = ("-O3", "-march=native", "-fopenmp")


def _cpu_identity() -> str:
    """The CPU's model name and flags (Linux), else the platform's processor string."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return platform.processor()
    return "\n".join(line for line in first.splitlines() if line.startswith(("model name", "flags")))


def build_folder(root: Path | None = None) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    parts = (SOURCE.read_bytes().hex(), " ".join(CFLAGS), torch.__version__, sys.version, _cpu_identity())
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return (root or Path(base) / "tandem" / "kernels") / f"cpu_paged-{key}"


def is_loaded() -> bool:
    return hasattr(torch.ops.tandem, "paged_decode")


@functools.cache
def load() -> bool:
    """Loads the kernels, building them first when the cache has none; False (and the reason
    logged) when they cannot be built or loaded here."""
    if is_loaded():
        return True
    folder = build_folder()
    library = folder / f"{NAME}.so"
    try:
        if library.is_file() and not (folder / "lock").exists():
            try:
                torch.ops.load_library(str(library))
            except OSError as error:  # a copy cut short (a build killed while linking): build it again
                log.warning("rebuilding the C++ CPU kernels: %s", error)
                library.unlink()
                _build(folder)
        else:
            _build(folder)
    except (OSError, RuntimeError, subprocess.SubprocessError, ImportError) as error:
        log.warning("C++ CPU kernels unavailable (%s: %s); using the torch attention path", type(error).__name__, error)
        return False
    return is_loaded()


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
            cpp_extension.load(NAME, [str(SOURCE)], extra_cflags=list(CFLAGS), build_directory=str(folder), is_python_module=False)
    finally:
        os.environ["PATH"] = path


def main() -> None:
    """Builds (or finds) the kernels and says which: `make` runs it at install."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    available = load()
    print(f"C++ CPU kernels: {'built and loaded from ' + str(build_folder()) if available else 'unavailable (the torch path serves)'}")


if __name__ == "__main__":
    main()
