"""requirements/ (the lock, `make lock`) agrees with pyproject.toml: every requirement of the core
and of each locked extra is pinned at a version its specifier allows, nothing is pinned that no
requirement reaches, and every role's lock pins the versions that `make` installs (all.txt).

The lock is resolved for CPython 3.11 on Linux x86_64; markers are evaluated for that platform.
A failing test here means: run `make lock` and commit requirements/."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from lockfile import PROJECT, Pin, parse_lock
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[3]
LOCKS = ROOT / "requirements"
# The platform the lock is resolved for (the Makefile's UV_COMPILE), as marker variables.
LOCK_PLATFORM = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
ROLE_LOCKS = ("worker", "chat", "relay", "router")


def make_extras() -> list[str]:
    """The extras `make` installs and all.txt locks: the Makefile's EXTRAS."""
    (line,) = [line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("EXTRAS :=")]
    return line.split(":=", 1)[1].strip().split(",")


def requirements(project: dict, extras: list[str]) -> list[Requirement]:
    """The core's requirements and those of `extras` that apply on the lock's platform."""
    texts = [(text, "") for text in project["dependencies"]]
    texts += [(text, extra) for extra in extras for text in project["optional-dependencies"][extra]]
    requirements = [(Requirement(text), extra) for text, extra in texts]
    return [req for req, extra in requirements if req.marker is None or req.marker.evaluate(LOCK_PLATFORM | {"extra": extra})]


def lock_problems(project: dict, extras: list[str], pins: dict[str, Pin]) -> list[str]:
    """Where the lock `pins` and pyproject's `project` table disagree for `extras`."""
    problems = []
    wanted = requirements(project, extras)
    for requirement in wanted:
        pin = pins.get(canonicalize_name(requirement.name))
        if pin is None:
            problems.append(f"{requirement}: not in the lock")
        elif not requirement.specifier.contains(pin.version, prereleases=True):
            problems.append(f"{requirement}: the lock pins {pin.version}")
        elif PROJECT not in pin.parents:
            problems.append(f"{requirement}: pinned, but the lock was made without it (no `via {PROJECT}`)")
    direct = {canonicalize_name(requirement.name) for requirement in wanted}
    for name, pin in pins.items():
        if PROJECT in pin.parents and name not in direct:
            problems.append(f"{name}: the lock says pyproject.toml requires it, pyproject.toml does not")
        if not pin.parents:
            problems.append(f"{name}: no `# via`, so nothing says why it is pinned")
        if unknown := pin.parents - set(pins) - {PROJECT}:
            problems.append(f"{name}: pinned for {sorted(unknown)}, which the lock does not pin")
    return problems


@pytest.fixture(scope="module")
def project() -> dict:
    project: dict = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def lock(name: str) -> dict[str, Pin]:
    return parse_lock((LOCKS / f"{name}.txt").read_text())


def test_make_installs_every_extra_that_pyproject_declares(project: dict) -> None:
    assert sorted(make_extras()) == sorted(project["optional-dependencies"])


def test_the_full_lock_pins_every_requirement_of_pyproject_and_nothing_else(project: dict) -> None:
    assert lock_problems(project, make_extras(), lock("all")) == []


@pytest.mark.parametrize("role", ROLE_LOCKS)
def test_a_role_lock_pins_the_core_and_its_extra_at_the_versions_make_installs(project: dict, role: str) -> None:
    pins, everything = lock(role), lock("all")
    assert lock_problems(project, [role], pins) == []
    differing = {name: (str(pin.version), str(everything[name].version) if name in everything else None) for name, pin in pins.items()}
    assert {name: versions for name, versions in differing.items() if versions[0] != versions[1]} == {}


def test_every_lock_says_what_it_covers() -> None:
    for path in sorted(LOCKS.glob("*.txt")):
        header = "\n".join(line for line in path.read_text().splitlines()[:5] if line.startswith("#"))
        assert "CPython 3.11" in header and "Linux x86_64" in header and "make lock" in header, path.name


def test_the_check_finds_a_stale_pin_a_missing_pin_and_a_leftover_pin(project: dict) -> None:
    """The checks above can fail: a pyproject.toml changed after the lock was made is caught."""
    pins = lock("router")

    def new_problems(changed: dict) -> list[str]:
        return [problem for problem in lock_problems(changed, ["router"], pins) if problem not in lock_problems(project, ["router"], pins)]

    others = [text for text in project["dependencies"] if not text.startswith("httpx")]
    assert new_problems(project | {"dependencies": [*others, "httpx>=999"]}) == [f"httpx>=999: the lock pins {pins['httpx'].version}"]
    assert new_problems(project | {"dependencies": [*project["dependencies"], "tqdm>=4"]}) == ["tqdm>=4: not in the lock"]
    indirect = [*project["dependencies"], "anyio>=4"]  # pinned, for fastapi
    assert new_problems(project | {"dependencies": indirect}) == [
        f"anyio>=4: pinned, but the lock was made without it (no `via {PROJECT}`)"
    ]
    dropped = new_problems(project | {"dependencies": others})
    assert dropped == ["httpx: the lock says pyproject.toml requires it, pyproject.toml does not"]
