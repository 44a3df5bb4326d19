"""What the worksheet's replica means for a deployment: one prefill or decode worker is one replica,
so its settings come from the worksheet's own numbers, the same in `tandem up`'s flags,
docker-compose.gpu.yml and deploy/k8s/overlays/gpu (tests/unit/deploy/test_gpu_replica.py checks
the files against the worksheet they name)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.ops.plan_inputs import Assumptions, Deployment
from tandem.ops.units import fmt_count, fmt_pct
from tandem.ops.worksheet import Worksheet


@dataclass(frozen=True)
class ReplicaSettings:
    tensor_parallel_size: int  # the replica's GPUs, one rank each (nvidia.com/gpu on a worker's pod)
    gpu_memory_utilization: float  # each GPU's share for weights, activations and KV: what the reserve leaves
    max_model_len_at_most: int  # the KV tokens a replica holds: a longer max-model-len cannot start
    quantization: str = "none"  # fp8 where the worksheet sized fp8 weights (a bf16 checkpoint quantized as it loads)
    kv_cache_dtype: str = "auto"  # fp8 where it sized an fp8 KV cache


def replica_settings(deployment: Deployment, assumptions: Assumptions, worksheet: Worksheet) -> ReplicaSettings:
    return ReplicaSettings(
        tensor_parallel_size=deployment.gpus_per_replica,
        gpu_memory_utilization=round(1 - assumptions.runtime_reserve, 6),
        max_model_len_at_most=worksheet.kv_tokens_per_replica,
        quantization="fp8" if deployment.weight_dtype == "fp8" else "none",
        kv_cache_dtype="fp8" if deployment.kv_dtype == "fp8" else "auto",
    )


def render_replica_settings(settings: ReplicaSettings, assumptions: Assumptions) -> list[str]:
    """The section the text worksheet ends with: each setting, its value, and where it comes from."""
    rows = [
        (
            "--tensor-parallel-size",
            f"{settings.tensor_parallel_size}",
            f"GPUs per replica (TANDEM_TENSOR_PARALLEL_SIZE; nvidia.com/gpu: {settings.tensor_parallel_size} on a worker's pod)",
        ),
        (
            "--gpu-memory-utilization",
            f"{settings.gpu_memory_utilization:g}",
            f"1 - {fmt_pct(assumptions.runtime_reserve)} runtime reserve (TANDEM_GPU_MEMORY_UTILIZATION)",
        ),
        (
            "--max-model-len",
            f"<= {fmt_count(settings.max_model_len_at_most)}",
            "KV tokens per replica: one sequence must fit (TANDEM_MAX_MODEL_LEN)",
        ),
    ]
    if settings.quantization != "none":
        rows.append(
            ("--quantization", settings.quantization, "fp8 weights (TANDEM_QUANTIZATION; a pre-quantized FP8 checkpoint needs none)")
        )
    if settings.kv_cache_dtype != "auto":
        rows.append(("--kv-cache-dtype", settings.kv_cache_dtype, "an fp8 KV cache (TANDEM_KV_CACHE_DTYPE)"))
    flag_width = max(len(flag) for flag, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    return [
        "each prefill or decode worker is one replica: tandem up, docker-compose.gpu.yml, deploy/k8s/overlays/gpu",
        *(f"  {flag:<{flag_width}}  {value:>{value_width}}  = {source}" for flag, value, source in rows),
    ]
