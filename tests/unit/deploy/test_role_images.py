"""What each Dockerfile target installs, read from the Dockerfile and the lock it installs: every
`pip install` is a lock (requirements/<lock>.txt, copied in) or a pinned --no-deps install, so the
image's packages are exactly that lock's; the router, relay and chat locks have no torch and
nothing CUDA; and each of those services imports with only its lock's packages importable."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from lockfile import parse_lock
from packaging.utils import canonicalize_name

from tandem.config import ROLES

ROOT = Path(__file__).resolve().parents[3]
ROLE_LOCK = {"prefill": "worker", "decode": "worker", "router": "router", "relay": "relay", "chat": "chat"}
SLIM_ROLES = ("router", "relay", "chat")
GPU_PACKAGES = ("torch", "triton", "nvidia-", "cuda-", "ucxx", "libucx", "rmm", "librmm")


def stage_instructions() -> dict[str, list[tuple[str, str]]]:
    """Each target's instructions, its parent stages' first (FROM <stage> chains)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    with (ROOT / "Dockerfile").open("rb") as file:
        structure = DockerfileParser(fileobj=file).structure
    for item in structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            parent, _, name = value.split()
            current = stages[name] = list(stages.get(parent, []))
        elif instruction != "COMMENT":
            current.append((instruction, value))
    return stages


def pip_installs(instructions: list[tuple[str, str]]) -> list[list[str]]:
    """The arguments of every `pip install` the instructions run."""
    commands = [command for kind, value in instructions if kind == "RUN" for command in value.split("&&")]
    return [words[2:] for words in map(shlex.split, commands) if words[:2] == ["pip", "install"]]


def installed_locks(instructions: list[tuple[str, str]]) -> list[Path]:
    """The repo's lock files that `pip install -r` reads in the image (COPY source -> -r path)."""
    copied = {}
    for kind, value in instructions:
        words = shlex.split(value)
        if kind == "COPY" and not words[0].startswith("--"):
            copied[words[-1]] = ROOT / words[0]
    return [copied[args[args.index("-r") + 1]] for args in pip_installs(instructions) if "-r" in args]


@pytest.fixture(scope="module")
def stages() -> dict[str, list[tuple[str, str]]]:
    return stage_instructions()


@pytest.mark.parametrize("role", ROLES)
def test_a_target_installs_its_lock_and_nothing_else_that_resolves(stages: dict[str, list[tuple[str, str]]], role: str) -> None:
    assert installed_locks(stages[role]) == [ROOT / "requirements" / f"{ROLE_LOCK[role]}.txt"]
    for args in pip_installs(stages[role]):
        if "-r" in args:
            continue
        assert "--no-deps" in args, f"{role}: pip install {shlex.join(args)} resolves outside the lock"
        for target in (arg for arg in args if not arg.startswith("-")):
            assert "==" in target or target.startswith("/tmp/wheels/"), f"{role}: {target} is neither pinned nor the project's wheel"


@pytest.mark.parametrize("role", ROLES)
def test_only_the_worker_images_carry_torch_and_cuda(stages: dict[str, list[tuple[str, str]]], role: str) -> None:
    packages = {name for lock in installed_locks(stages[role]) for name in parse_lock(lock.read_text())}
    gpu = sorted(name for name in packages if name.startswith(GPU_PACKAGES))
    if role in SLIM_ROLES:
        assert gpu == [], f"the {role} image installs {gpu}"
    else:
        assert "torch" in gpu and any(name.startswith("nvidia-") for name in gpu), gpu


# Imports `module` with the packages of this environment that are not in the lock blocked, as in
# the image: an import of one (torch) fails the way it would there.
_IMPORT_WITH_ONLY = """
import importlib, importlib.abc, importlib.metadata, sys
from packaging.utils import canonicalize_name
module, allowed = sys.argv[1], set(sys.argv[2].split(","))
owners = importlib.metadata.packages_distributions()
class NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        dists = {canonicalize_name(dist) for dist in owners.get(top, ())}
        if dists and not dists & allowed:
            raise ModuleNotFoundError(f"{name}: {sorted(dists)} is not in the image", name=name)
        return None
sys.meta_path.insert(0, NotInTheImage())
importlib.import_module(module)
blocked = sorted(name for name in sys.modules if name.partition(".")[0] in ("torch", "triton"))
assert not blocked, blocked
"""


@pytest.mark.parametrize("role", SLIM_ROLES)
def test_a_slim_service_imports_with_only_its_locks_packages(role: str) -> None:
    allowed = {*parse_lock((ROOT / "requirements" / f"{ROLE_LOCK[role]}.txt").read_text()), canonicalize_name("tandem-serve")}
    command = [sys.executable, "-c", _IMPORT_WITH_ONLY, f"services.{role}.app", ",".join(sorted(allowed))]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_import_check_fails_where_a_package_is_not_in_the_lock() -> None:
    """The check above can fail: the router without fastapi in its image does not import."""
    allowed = set(parse_lock((ROOT / "requirements" / "router.txt").read_text())) - {"fastapi"} | {"tandem-serve"}
    command = [sys.executable, "-c", _IMPORT_WITH_ONLY, "services.router.app", ",".join(sorted(allowed))]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "['fastapi'] is not in the image" in result.stderr, result.stderr[-3000:]
