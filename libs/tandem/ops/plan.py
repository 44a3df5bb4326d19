"""`tandem plan`: a capacity worksheet from first principles, each line with its formula.

    tandem plan --layers 80 --kv-heads 8 --head-dim 128 --params 70e9 --dtype bf16 --gpu h100 \\
        --gpus-per-replica 4 --context-tokens 2000 --output-tokens-per-s 50e6 --prompt-tokens-per-s 100e6 [--json]
    tandem plan --model [PATH] --gpu cpu --measure-bandwidth --measure-flops

The flag and JSON key names are an interface: scripts depend on them. The worksheet ends with the
settings that deploy its replica as one worker (plan_deploy; JSON `deploy`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from tandem.errors import StartupError
from tandem.ops.gpus import GPU_CHOICES, Gpu, GpuOverrides, resolve_gpu
from tandem.ops.model_shape import DTYPE_BYTES, ModelShape, read_model_shape
from tandem.ops.plan_deploy import replica_settings
from tandem.ops.plan_inputs import Assumptions, Deployment, Traffic
from tandem.ops.plan_text import render
from tandem.ops.worksheet import compute

DEFAULTS = Assumptions()
ASSUMPTION_HELP = {
    "runtime_reserve": "fraction of a replica's memory kept for the runtime (CUDA context, activations)",
    "bandwidth_efficiency": "achieved / peak memory bandwidth in a real decode step",
    "compute_efficiency": "achieved / peak dense FLOP/s (prefill, and decode's compute bound)",
    "headroom": "capacity above peak traffic (0.2: 20 %% more)",
    "pue": "facility power / IT power",
    "server_power_factor": "server power / its GPUs' board power (a DGX H100: 10.2 kW for 8 x 700 W)",
    "kw_per_server": "kW per server (default: GPUs per server x board power x --server-power-factor)",
    "gpu_hour_price": "$ per GPU-hour (default: the GPU table's indicative price)",
    "average_busyness": "average traffic / the fleet's full-use capacity, for the average cost per Mtok",
}
BANDWIDTH_MIB, FLOPS_MATMUL_SIZE, MEASURE_REPEATS = 256, 2048, 5


def _number(text: str) -> float:
    """A finite number, in any float spelling (70e9, 0.6)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def add_cli(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="capacity worksheet: KV, decode/prefill speed, GPUs, power and cost for a model on a GPU",
        description="Sizes a fleet from a model's shape and a GPU's datasheet, every line with its formula. "
        "Give the shape (--layers --kv-heads --head-dim --params) or --model; shape flags given with --model override it.",
    )
    shape = parser.add_argument_group("model")
    shape.add_argument(
        "--model",
        nargs="?",
        const="",
        metavar="PATH",
        help="read the shape from a .gguf or safetensors folder (no PATH: the embedded SmolLM2)",
    )
    shape.add_argument("--layers", type=int, metavar="N", help="transformer layers")
    shape.add_argument("--kv-heads", type=int, metavar="N", help="key/value heads (grouped-query attention)")
    shape.add_argument("--head-dim", type=int, metavar="N", help="dimension of one attention head")
    shape.add_argument("--params", type=_number, metavar="N", help="parameter count (70e9)")
    shape.add_argument(
        "--dtype", choices=tuple(DTYPE_BYTES), help="weights (default: the model's, else bf16; --gpu cpu: the engine's CPU dtype)"
    )
    shape.add_argument("--kv-dtype", choices=tuple(DTYPE_BYTES), help="KV cache (default: --dtype)")
    gpu = parser.add_argument_group("GPU")
    gpu.add_argument("--gpu", default="h100", metavar="NAME", help=f"one of {', '.join(GPU_CHOICES)} (default h100)")
    gpu.add_argument("--gpu-memory-gb", type=_number, metavar="GB", help="memory per GPU, GB (1e9 B); replaces the table's")
    gpu.add_argument("--gpu-bandwidth-gbs", type=_number, metavar="GBS", help="memory bandwidth per GPU, GB/s")
    gpu.add_argument("--gpu-tflops", type=_number, metavar="TFLOPS", help="dense TFLOP/s per GPU in the worksheet's dtype")
    gpu.add_argument("--gpu-power-w", type=_number, metavar="W", help="board power per GPU, W")
    gpu.add_argument("--measure-bandwidth", action="store_true", help="--gpu cpu: measure this machine's copy bandwidth")
    gpu.add_argument("--measure-flops", action="store_true", help="--gpu cpu: measure this machine's matmul FLOP/s")
    fleet = parser.add_argument_group("deployment and traffic")
    fleet.add_argument("--gpus-per-replica", type=int, metavar="N", default=1, help="GPUs holding one model copy (default 1)")
    fleet.add_argument("--context-tokens", type=int, metavar="N", default=2000, help="tokens of KV each sequence holds (default 2000)")
    fleet.add_argument(
        "--max-sequences", type=int, metavar="N", help="cap on running sequences per replica (default: as many as the KV holds)"
    )
    fleet.add_argument("--gpus-per-server", type=int, metavar="N", help="default 8 (--gpu cpu: 1)")
    fleet.add_argument("--output-tokens-per-s", type=_number, metavar="RATE", default=0.0, help="output tokens/s at peak")
    fleet.add_argument("--prompt-tokens-per-s", type=_number, metavar="RATE", default=0.0, help="uncached prompt tokens/s at peak")
    settings = parser.add_argument_group("assumptions")
    for field in dataclasses.fields(Assumptions):
        default = getattr(DEFAULTS, field.name)
        shown = "" if default is None else f" (default {default:g})"
        settings.add_argument(
            f"--{field.name.replace('_', '-')}", type=_number, default=default, metavar="X", help=ASSUMPTION_HELP[field.name] + shown
        )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    model = _model_shape(args)
    gpu = _gpu(args, model)
    weight_dtype = args.dtype or (_cpu_engine_dtype() if args.gpu.lower() == "cpu" else model.dtype)
    deployment = Deployment(
        gpus_per_replica=args.gpus_per_replica,
        context_tokens=args.context_tokens,
        weight_dtype=weight_dtype,
        kv_dtype=args.kv_dtype or weight_dtype,
        gpus_per_server=args.gpus_per_server or (1 if args.gpu.lower() == "cpu" else 8),
        max_sequences=args.max_sequences,
    )
    traffic = Traffic(output_tokens_per_s=args.output_tokens_per_s, prompt_tokens_per_s=args.prompt_tokens_per_s)
    assumptions = Assumptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Assumptions)})
    worksheet = compute(model, gpu, deployment, traffic, assumptions)
    if args.json:
        inputs: dict[str, Any] = {
            "model": dataclasses.asdict(model),
            "gpu": dataclasses.asdict(gpu),
            "deployment": dataclasses.asdict(deployment),
            "traffic": dataclasses.asdict(traffic),
            "assumptions": dataclasses.asdict(assumptions),
        }
        deploy = dataclasses.asdict(replica_settings(deployment, assumptions, worksheet))
        print(json.dumps({**inputs, **worksheet.values(), "formulas": worksheet.formulas(), "deploy": deploy}, indent=2))
    else:
        print(render(model, gpu, deployment, traffic, assumptions, worksheet))
    return 0


def _model_shape(args: argparse.Namespace) -> ModelShape:
    given = {"num_layers": args.layers, "num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "num_params": args.params}
    given = {name: value for name, value in given.items() if value is not None}
    if "num_params" in given:
        given["num_params"] = round(given["num_params"])
    if args.model is not None:
        return dataclasses.replace(read_model_shape(Path(args.model) if args.model else None), **given)
    missing = [
        flag
        for flag, name in (
            ("--layers", "num_layers"),
            ("--kv-heads", "num_kv_heads"),
            ("--head-dim", "head_dim"),
            ("--params", "num_params"),
        )
        if name not in given
    ]
    if missing:
        raise StartupError(f"give the model's shape ({', '.join(missing)} missing) or --model PATH")
    return ModelShape(name=f"{given['num_params'] / 1e9:g}B-parameter model", dtype="bf16", **given)


def _gpu(args: argparse.Namespace, model: ModelShape) -> Gpu:
    is_cpu = args.gpu.lower() == "cpu"
    if (args.measure_bandwidth or args.measure_flops) and not is_cpu:
        raise StartupError("--measure-bandwidth and --measure-flops measure this machine: use them with --gpu cpu")
    for flag, value in (
        ("--gpu-memory-gb", args.gpu_memory_gb),
        ("--gpu-bandwidth-gbs", args.gpu_bandwidth_gbs),
        ("--gpu-tflops", args.gpu_tflops),
        ("--gpu-power-w", args.gpu_power_w),
    ):
        if value is not None and value <= 0:
            raise StartupError(f"{flag} must be positive, not {value:g}")
    bandwidth = args.gpu_bandwidth_gbs * 1e9 if args.gpu_bandwidth_gbs is not None else None
    flops = args.gpu_tflops * 1e12 if args.gpu_tflops is not None else None
    cpu_memory = None
    if is_cpu:
        from tandem.ops import measure  # torch: loaded only to measure

        cpu_memory = measure.physical_memory_bytes()
        if args.measure_bandwidth:
            bandwidth = measure.measure_copy_bandwidth(BANDWIDTH_MIB, MEASURE_REPEATS)
        if args.measure_flops:
            flops = measure.measure_peak_flops(_torch_dtype(args.dtype or _cpu_engine_dtype()), FLOPS_MATMUL_SIZE, MEASURE_REPEATS)
    overrides = GpuOverrides(
        memory_bytes=args.gpu_memory_gb * 1e9 if args.gpu_memory_gb is not None else None,
        bandwidth_bytes_per_s=bandwidth,
        flops=flops,
        board_power_w=args.gpu_power_w,
    )
    return resolve_gpu(args.gpu, overrides, cpu_memory)


def _cpu_engine_dtype() -> str:
    """The dtype the engine picks on this CPU (bf16 where it is native, else fp32)."""
    import torch

    from tandem.models.loader import default_dtype

    return "bf16" if default_dtype("cpu") == torch.bfloat16 else "fp32"


def _torch_dtype(dtype: str) -> Any:
    import torch

    # no fp8 matmul on a CPU: fp8 weights are upcast to bf16 to compute
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[dtype]
