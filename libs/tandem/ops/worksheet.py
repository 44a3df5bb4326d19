"""The capacity worksheet's arithmetic: from a model's shape and a GPU to replicas, GPUs, power and cost.

Pure arithmetic. Each quantity is recorded with the formula that made it, its numbers substituted,
where it is computed, so the printed formula and the value cannot drift apart. Decode is bounded
by memory traffic (every step reads the weights and every running sequence's KV once), prefill by
compute (2 FLOPs per parameter per token); both are first-principles floors, scaled by an
efficiency to a realistic figure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tandem.errors import StartupError
from tandem.ops.fleet import size_fleet
from tandem.ops.gpus import Gpu
from tandem.ops.model_shape import DTYPE_BYTES, ModelShape
from tandem.ops.plan_inputs import Assumptions, Deployment, Traffic, check_at_least
from tandem.ops.sheet import Line, Sheet
from tandem.ops.units import fmt_bytes, fmt_count, fmt_flops, fmt_ms, fmt_params, fmt_pct, fmt_rate


@dataclass(frozen=True)
class Worksheet:
    weight_bytes: float
    kv_bytes_per_token: float
    replica_memory_bytes: float
    runtime_reserve_bytes: float
    kv_bytes_per_replica: float
    kv_tokens_per_replica: int
    sequences_per_replica: int
    decode_bytes_per_step: float
    decode_step_ms_floor: float
    decode_step_ms_memory: float
    decode_flops_per_step: float
    decode_step_ms_compute: float
    decode_step_ms: float
    decode_bound: str  # "memory" | "compute"
    single_stream_step_ms_floor: float
    tokens_per_s_per_stream_floor: float
    tokens_per_s_per_stream: float
    tokens_per_s_per_replica_floor: float
    tokens_per_s_per_replica: float
    prefill_tokens_per_s_per_gpu: float
    lines: tuple[Line, ...]
    # the fleet: None when no traffic was given (and power/cost when a figure they need is unknown)
    decode_replicas: int | None = None
    decode_gpus: int | None = None
    prefill_replicas: int | None = None
    prefill_gpus: int | None = None
    total_gpus: int | None = None
    servers: int | None = None
    kw_per_server: float | None = None
    power_mw: float | None = None
    cost_per_hour: float | None = None
    cost_per_day: float | None = None
    fleet_output_tokens_per_s: float | None = None
    cost_per_million_output_tokens_full_use: float | None = None
    cost_per_million_output_tokens_average: float | None = None

    def values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "lines"}

    def formulas(self) -> dict[str, str]:
        return {line.key: line.formula for line in self.lines}


def compute(shape: ModelShape, gpu: Gpu, deployment: Deployment, traffic: Traffic, assumptions: Assumptions) -> Worksheet:
    _check_deployment(deployment, traffic, shape)
    sheet = Sheet()
    _memory(sheet, shape, gpu, deployment, assumptions)
    _decode(sheet, shape, gpu, deployment, assumptions)
    sheet.add(
        "prefill_tokens_per_s_per_gpu",
        "prefill per GPU",
        value := gpu.flops_for(deployment.weight_dtype) * assumptions.compute_efficiency / (2 * shape.num_params),
        f"{fmt_rate(value)} tokens/s",
        f"{fmt_flops(gpu.flops_for(deployment.weight_dtype))} ({deployment.weight_dtype}) x "
        f"{fmt_pct(assumptions.compute_efficiency)} / (2 FLOPs x {fmt_params(shape.num_params)})",
    )
    if traffic.is_given:
        size_fleet(sheet, gpu, deployment, traffic, assumptions)
    return Worksheet(**sheet.values, lines=tuple(sheet.lines))


def _check_deployment(deployment: Deployment, traffic: Traffic, shape: ModelShape) -> None:
    for flag, count in (
        ("--gpus-per-replica", deployment.gpus_per_replica),
        ("--context-tokens", deployment.context_tokens),
        ("--gpus-per-server", deployment.gpus_per_server),
        ("--max-sequences", 1 if deployment.max_sequences is None else deployment.max_sequences),
    ):
        if count < 1:
            raise StartupError(f"{flag} must be at least 1, not {count}")
    if shape.context_window is not None and deployment.context_tokens > shape.context_window:
        raise StartupError(f"--context-tokens {deployment.context_tokens} is longer than {shape.name}'s window of {shape.context_window}")
    for flag, dtype in (("--dtype", deployment.weight_dtype), ("--kv-dtype", deployment.kv_dtype)):
        if dtype not in DTYPE_BYTES:
            raise StartupError(f"{flag} {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    for flag, rate in (("--output-tokens-per-s", traffic.output_tokens_per_s), ("--prompt-tokens-per-s", traffic.prompt_tokens_per_s)):
        check_at_least(flag, rate, 0.0)


def _memory(sheet: Sheet, shape: ModelShape, gpu: Gpu, deployment: Deployment, assumptions: Assumptions) -> None:
    weight_size, kv_size = DTYPE_BYTES[deployment.weight_dtype], DTYPE_BYTES[deployment.kv_dtype]
    weights = sheet.add(
        "weight_bytes",
        "weights",
        shape.num_params * weight_size,
        fmt_bytes(shape.num_params * weight_size),
        f"{fmt_params(shape.num_params)} x {weight_size} B ({deployment.weight_dtype})",
    )
    per_token = sheet.add(
        "kv_bytes_per_token",
        "KV per token",
        2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_size,
        fmt_bytes(2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_size),
        f"2 (K and V) x {shape.num_layers} layers x {shape.num_kv_heads} KV heads x {shape.head_dim} head dim x "
        f"{kv_size} B ({deployment.kv_dtype})",
    )
    gpus = deployment.gpus_per_replica
    memory = sheet.add(
        "replica_memory_bytes",
        "replica memory",
        gpus * gpu.memory_bytes,
        fmt_bytes(gpus * gpu.memory_bytes),
        f"{gpus} x {fmt_bytes(gpu.memory_bytes)}",
    )
    reserve = sheet.add(
        "runtime_reserve_bytes",
        "runtime reserve",
        memory * assumptions.runtime_reserve,
        fmt_bytes(memory * assumptions.runtime_reserve),
        f"{fmt_pct(assumptions.runtime_reserve)} x {fmt_bytes(memory)}",
    )
    kv_memory = memory - reserve - weights
    if kv_memory <= 0:
        raise StartupError(
            f"the weights ({fmt_bytes(weights)}) and the runtime reserve ({fmt_bytes(reserve)}) fill the replica's "
            f"{fmt_bytes(memory)}: raise --gpus-per-replica, or use --dtype fp8"
        )
    sheet.add(
        "kv_bytes_per_replica",
        "memory left for KV",
        kv_memory,
        fmt_bytes(kv_memory),
        f"{fmt_bytes(memory)} - {fmt_bytes(reserve)} reserve - {fmt_bytes(weights)} weights",
    )
    kv_tokens = sheet.add(
        "kv_tokens_per_replica",
        "KV tokens per replica",
        int(kv_memory // per_token),
        f"{fmt_count(kv_memory // per_token)} tokens",
        f"floor({fmt_bytes(kv_memory)} / {fmt_bytes(per_token)})",
    )
    fitting = kv_tokens // deployment.context_tokens
    cap = deployment.max_sequences
    formula = f"floor({fmt_count(kv_tokens)} tokens / {fmt_count(deployment.context_tokens)} context tokens)"
    sequences = sheet.add(
        "sequences_per_replica",
        "sequences per replica",
        fitting if cap is None else min(fitting, cap),
        f"{fmt_count(fitting if cap is None else min(fitting, cap))} sequences",
        formula if cap is None else f"min({formula}, {cap} max sequences)",
    )
    if sequences < 1:
        raise StartupError(
            f"a replica holds {fmt_count(kv_tokens)} KV tokens, not one {fmt_count(deployment.context_tokens)}-token sequence: "
            "raise --gpus-per-replica or lower --context-tokens"
        )


def _decode(sheet: Sheet, shape: ModelShape, gpu: Gpu, deployment: Deployment, assumptions: Assumptions) -> None:
    v = sheet.values
    gpus, context, sequences = deployment.gpus_per_replica, deployment.context_tokens, v["sequences_per_replica"]
    bandwidth = gpus * gpu.bandwidth_bytes_per_s
    step_bytes = v["weight_bytes"] + sequences * context * v["kv_bytes_per_token"]
    sheet.add(
        "decode_bytes_per_step",
        "bytes read per decode step",
        step_bytes,
        fmt_bytes(step_bytes),
        f"{fmt_bytes(v['weight_bytes'])} weights + {fmt_count(sequences)} sequences x {fmt_count(context)} tokens x "
        f"{fmt_bytes(v['kv_bytes_per_token'])}",
    )
    bandwidth_text = f"({gpus} x {fmt_bytes(gpu.bandwidth_bytes_per_s)}/s)"
    floor_ms = sheet.add(
        "decode_step_ms_floor",
        "decode step floor",
        1e3 * step_bytes / bandwidth,
        fmt_ms(1e3 * step_bytes / bandwidth),
        f"{fmt_bytes(step_bytes)} / {bandwidth_text}",
    )
    memory_ms = sheet.add(
        "decode_step_ms_memory",
        "decode step, memory",
        floor_ms / assumptions.bandwidth_efficiency,
        fmt_ms(floor_ms / assumptions.bandwidth_efficiency),
        f"{fmt_ms(floor_ms)} / {fmt_pct(assumptions.bandwidth_efficiency)} bandwidth efficiency",
    )
    flops = sheet.add(
        "decode_flops_per_step",
        "decode FLOPs per step",
        2 * shape.num_params * sequences,
        fmt_flops(2 * shape.num_params * sequences, per_s=False),
        f"2 x {fmt_params(shape.num_params)} x {fmt_count(sequences)} sequences",
    )
    peak = gpus * gpu.flops_for(deployment.weight_dtype) * assumptions.compute_efficiency
    compute_ms = sheet.add(
        "decode_step_ms_compute",
        "decode step, compute",
        1e3 * flops / peak,
        fmt_ms(1e3 * flops / peak),
        f"{fmt_flops(flops, per_s=False)} / ({gpus} x {fmt_flops(gpu.flops_for(deployment.weight_dtype))} x "
        f"{fmt_pct(assumptions.compute_efficiency)})",
    )
    bound = "memory" if memory_ms >= compute_ms else "compute"
    v["decode_bound"] = bound
    step_ms = sheet.add(
        "decode_step_ms",
        "decode step",
        max(memory_ms, compute_ms),
        f"{fmt_ms(max(memory_ms, compute_ms))} ({bound}-bound)",
        f"max({fmt_ms(memory_ms)} memory, {fmt_ms(compute_ms)} compute)",
    )
    single_bytes = v["weight_bytes"] + context * v["kv_bytes_per_token"]
    sheet.add(
        "single_stream_step_ms_floor",
        "one sequence alone, step floor",
        1e3 * single_bytes / bandwidth,
        fmt_ms(1e3 * single_bytes / bandwidth),
        f"({fmt_bytes(v['weight_bytes'])} + {fmt_count(context)} tokens x {fmt_bytes(v['kv_bytes_per_token'])}) / {bandwidth_text}",
    )
    for suffix, label, ms in (("_floor", "floor", floor_ms), ("", "realistic", step_ms)):
        sheet.add(
            f"tokens_per_s_per_stream{suffix}", f"per stream, {label}", 1e3 / ms, f"{fmt_rate(1e3 / ms)} tokens/s", f"1000 / {fmt_ms(ms)}"
        )
    for suffix, label, ms in (("_floor", "floor", floor_ms), ("", "realistic", step_ms)):
        sheet.add(
            f"tokens_per_s_per_replica{suffix}",
            f"per replica, {label}",
            1e3 * sequences / ms,
            f"{fmt_rate(1e3 * sequences / ms)} tokens/s",
            f"{fmt_count(sequences)} sequences x 1000 / {fmt_ms(ms)}",
        )
