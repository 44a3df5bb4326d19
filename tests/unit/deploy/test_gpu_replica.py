"""The GPU deploy files and `tandem plan` describe one replica with the same numbers: the k8s GPU
overlay and docker-compose.gpu.yml give each prefill and decode worker TANDEM_TENSOR_PARALLEL_SIZE
GPUs (nvidia.com/gpu; compose's device ids, no two workers sharing one), a /dev/shm in memory for
NCCL, and a KV cache sized by memory share and max model length, not in MiB; and the worksheet
each file names (the 70B-class model on H100s in docs/operations.md) deploys its replica with those settings."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from kustomize_lite import Object, render

from tandem import cli
from tandem.ops.gpus import GPUS

ROOT = Path(__file__).resolve().parents[3]
WORKERS = ("prefill", "decode")
GPU_OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "gpu"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
GIB = 1 << 30
NCCL_SHM_BYTES = GIB  # a container's default /dev/shm is 64 MiB; NCCL's ranks need far more
_SIZE = re.compile(r"^(\d+)\s*([kmgKMG]i?[bB]?)?$")


def size_bytes(text: str) -> int:
    """A compose size (8gb) or a Kubernetes quantity (8Gi) in bytes."""
    match = _SIZE.match(str(text))
    assert match, text
    unit = (match[2] or "").lower().rstrip("b").rstrip("i")
    return int(match[1]) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": GIB}[unit]


def plan_command(path: Path) -> list[str]:
    """The `tandem plan` command a file's header comment names as its worksheet."""
    (line,) = [line for line in path.read_text().splitlines() if line.startswith("#") and "tandem plan --" in line]
    return shlex.split(line.split("tandem plan", 1)[1])


def worksheet(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict[str, Any]:
    assert cli.main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def k8s_workers() -> dict[str, Object]:
    deployments = {item["metadata"]["name"]: item for item in render(GPU_OVERLAY) if item["kind"] == "StatefulSet"}
    return {role: deployments[role] for role in WORKERS}


@pytest.fixture(scope="module")
def compose_workers() -> dict[str, Any]:
    services = yaml.safe_load(COMPOSE_GPU.read_text())["services"]
    assert set(services) == set(WORKERS), "the GPU file changes the workers only"
    return services


def test_the_compose_gpu_file_only_reads_variables_it_defaults() -> None:
    uses = re.findall(r"\$\{[^}]*\}", COMPOSE_GPU.read_text())
    assert uses and all(re.fullmatch(r"\$\{\w+:-[^}]+\}", use) for use in uses), uses


def k8s_env(deployment: Object) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {item["name"]: item["value"] for item in container["env"] if "value" in item}


def test_a_k8s_gpu_worker_asks_a_gpu_per_rank_and_a_shared_memory_for_nccl(k8s_workers: dict[str, Object]) -> None:
    for role, deployment in k8s_workers.items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = k8s_env(deployment)
        num_ranks = int(env["TANDEM_TENSOR_PARALLEL_SIZE"])
        assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"] == num_ranks
        shm = {volume["name"]: volume for volume in pod["volumes"]}[
            next(mount["name"] for mount in container["volumeMounts"] if mount["mountPath"] == "/dev/shm")
        ]
        assert shm["emptyDir"]["medium"] == "Memory", role
        assert size_bytes(shm["emptyDir"]["sizeLimit"]) >= NCCL_SHM_BYTES, role
        assert size_bytes(shm["emptyDir"]["sizeLimit"]) < size_bytes(container["resources"]["limits"]["memory"]), (
            "it counts against the limit"
        )


def test_a_compose_gpu_worker_reserves_its_own_gpus_one_per_rank_and_a_shared_memory_for_nccl(compose_workers: dict[str, Any]) -> None:
    taken: list[str] = []
    for role, service in compose_workers.items():
        env = service["environment"]
        (devices,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert (devices["driver"], devices["capabilities"]) == ("nvidia", ["gpu"]), role
        assert "count" not in devices, "docker gives every container asking a count the same first GPUs"
        assert len(devices["device_ids"]) == int(env["TANDEM_TENSOR_PARALLEL_SIZE"]), role
        taken += devices["device_ids"]
        assert env["TANDEM_DEVICE"] == "cuda"
        assert size_bytes(service["shm_size"]) >= NCCL_SHM_BYTES, role
    assert taken == [str(index) for index in range(len(taken))], "prefill 0..N-1, decode N..2N-1, as tandem up gives them out"


def test_the_deploy_files_size_the_kv_cache_by_memory_share_and_max_model_len_alike(
    k8s_workers: dict[str, Object], compose_workers: dict[str, Any]
) -> None:
    names = ("TANDEM_TENSOR_PARALLEL_SIZE", "TANDEM_GPU_MEMORY_UTILIZATION", "TANDEM_MAX_MODEL_LEN")
    described = {f"k8s {role}": k8s_env(deployment) for role, deployment in k8s_workers.items()}
    described |= {f"compose {role}": service["environment"] for role, service in compose_workers.items()}
    for where, env in described.items():
        assert "TANDEM_KV_CACHE_MIB" not in env, f"{where}: a MiB figure holds for one model on one GPU only"
        assert 0 < float(env["TANDEM_GPU_MEMORY_UTILIZATION"]) <= 1, where
    assert len({tuple(env[name] for name in names) for env in described.values()}) == 1, {
        where: [env[name] for name in names] for where, env in described.items()
    }


@pytest.mark.parametrize("path", [GPU_OVERLAY / "workers.yaml", COMPOSE_GPU], ids=["k8s", "compose"])
def test_the_worksheet_a_deploy_file_names_deploys_its_replica_with_the_files_numbers(
    path: Path, capsys: pytest.CaptureFixture[str], k8s_workers: dict[str, Object], compose_workers: dict[str, Any]
) -> None:
    args = plan_command(path)
    operations = (ROOT / "docs" / "operations.md").read_text()
    seventy_b = next(line for line in operations.splitlines() if line.startswith("`tandem plan --layers 80"))
    assert seventy_b.startswith(f"`tandem plan {shlex.join(args)} "), "the 70B worksheet in docs/operations.md, its deployment flags first"
    result = worksheet(capsys, args)
    env = compose_workers["decode"]["environment"] if path == COMPOSE_GPU else k8s_env(k8s_workers["decode"])
    assert result["deployment"]["gpus_per_replica"] == result["deploy"]["tensor_parallel_size"] == int(env["TANDEM_TENSOR_PARALLEL_SIZE"])
    # the worker's share of each GPU is what the worksheet's runtime reserve leaves
    assert result["deploy"]["gpu_memory_utilization"] == float(env["TANDEM_GPU_MEMORY_UTILIZATION"])
    assert result["assumptions"]["runtime_reserve"] == pytest.approx(1 - float(env["TANDEM_GPU_MEMORY_UTILIZATION"]))
    # one max-length sequence fits the replica's KV many times over, and every planned one is shorter
    assert result["deploy"]["max_model_len_at_most"] == result["kv_tokens_per_replica"] >= int(env["TANDEM_MAX_MODEL_LEN"])
    assert result["deployment"]["context_tokens"] <= int(env["TANDEM_MAX_MODEL_LEN"])
    gpu = next(key for key, entry in GPUS.items() if entry.name == result["gpu"]["name"])
    cost = re.sub(r"^\$\{\w+:-([^}]*)\}$", r"\1", env["TANDEM_WORKER_HOUR_COST"])  # compose's default
    assert float(cost) == result["deploy"]["tensor_parallel_size"] * GPUS[gpu].hour_price, "a worker costs its GPUs"


def test_the_70b_worksheet_prints_the_settings_that_deploy_its_replica(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", *plan_command(COMPOSE_GPU)]) == 0
    lines = capsys.readouterr().out.splitlines()
    settings = {line.split()[0]: line.split("  = ")[0].split()[1:] for line in lines if line.strip().startswith("--")}
    assert settings == {"--tensor-parallel-size": ["4"], "--gpu-memory-utilization": ["0.9"], "--max-model-len": ["<=", "451,660"]}
