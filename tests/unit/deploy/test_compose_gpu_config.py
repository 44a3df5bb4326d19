"""`docker compose config` accepts docker-compose.gpu.yml over docker-compose.yml, and what it
merges is the GPU stack: each worker reserves its own NVIDIA GPUs, as many as its tensor-parallel
size, with a /dev/shm for NCCL; the other services reserve none. Compose itself validates the
merged file against its schema, so a misspelt key fails here rather than on a GPU host.
(test_gpu_replica.py checks the numbers against `tandem plan`.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from compose_cli import MISSING, compose_command

from tandem.config import ROLES
from tandem.devstack.secrets import StackSecrets, write_container_set

ROOT = Path(__file__).resolve().parents[3]
WORKERS = ("prefill", "decode")
GIB = 1 << 30


def compose_config(tmp_path: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    """`docker compose config` of `files` merged in order, with an API key and the credentials
    `tandem secrets` writes, as the GPU file's header runs it."""
    compose = compose_command()
    if compose is None:
        pytest.skip(MISSING)
    write_container_set(tmp_path, StackSecrets.generate(), is_overwrite=False)
    env = {name: value for name, value in os.environ.items() if not name.startswith("TANDEM_")} | {"TANDEM_API_KEYS": "k=u:plus"}
    command = [*compose, "--project-directory", str(ROOT), "--env-file", str(tmp_path / "tandem.env")]
    for file in files:
        command += ["-f", str(file)]
    return subprocess.run([*command, "config", "--format", "json"], cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = compose_config(tmp_path_factory.mktemp("gpu"), ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml")
    assert result.returncode == 0, result.stderr
    services: dict[str, Any] = json.loads(result.stdout)["services"]
    return services


def gpu_reservations(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [device for device in devices if "gpu" in device.get("capabilities", [])]


def test_each_worker_reserves_as_many_nvidia_gpus_as_its_tensor_parallel_size(merged: dict[str, Any]) -> None:
    taken: set[str] = set()
    for role in WORKERS:
        (reservation,) = gpu_reservations(merged[role])
        environment = merged[role]["environment"]
        assert reservation["driver"] == "nvidia", role
        assert environment["TANDEM_DEVICE"] == "cuda", role
        assert len(reservation["device_ids"]) == int(environment["TANDEM_TENSOR_PARALLEL_SIZE"]) > 1, role
        assert not taken & set(reservation["device_ids"]), f"{role} shares a GPU"
        taken |= set(reservation["device_ids"])
        assert int(merged[role]["shm_size"]) >= GIB, f"{role}: docker's 64 MiB /dev/shm is too small for NCCL"


def test_the_gpu_file_leaves_the_other_services_on_the_cpu(merged: dict[str, Any]) -> None:
    assert set(ROLES) <= set(merged)
    for name, service in merged.items():
        if name not in WORKERS:
            assert not gpu_reservations(service), name
            assert service.get("environment", {}).get("TANDEM_DEVICE") != "cuda", name


def test_compose_refuses_a_gpu_file_with_a_misspelt_key(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.gpu.yml"
    text = (ROOT / "docker-compose.gpu.yml").read_text()
    assert text.count("reservations:") == len(WORKERS)
    broken.write_text(text.replace("reservations:", "reservation:", 1))
    result = compose_config(tmp_path, ROOT / "docker-compose.yml", broken)
    assert result.returncode != 0
    assert "reservation" in result.stderr, result.stderr
