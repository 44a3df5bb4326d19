"""Paged attention backends on the engine's real batch shapes: reference vs torch path (and the C++ kernels on CPU, triton on CUDA).

    .venv/bin/python bench/attention.py [--dtype fp32 bf16] [--rounds 15] [--variants window softcap fp8]
        [--json build/bench/attention.json]

SmolLM2-135M attention shapes (9 heads, 3 kv heads, head_dim 64, 16-token blocks) over a
block-major cache with shuffled block ids; one layer's strided K/V views, as the model passes
them. Every backend runs on the same step in interleaved rounds of the same process and the
table reports each one's median and best time and its speedup over the reference measured in
this run (median over median, and best over best: on a shared machine the best is the steadier).
Where the CPU has AMX, `cpp-vector` is the C++ backend with its bf16 prefill chunks on the vector
units instead of AMX tiles: the measurement behind the default's choice.

A second table runs the fast backends on the same steps with a sliding window (256 of the ~400-600
token contexts: the kernels skip the blocks before it), Gemma 2's soft-cap (50) or an FP8 e4m3
cache, each against the plain case's median in the same run; the host's CPU flags head it.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.kernels import (
    AttentionFn,
    cpu_extension,
    paged_attention_cpu,
    paged_attention_reference,
    paged_attention_torch,
    paged_attention_triton,
)
from tandem.kernels.metadata import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
NUM_LAYERS = 2  # enough for the per-layer views to be strided; the real 30 would only add memory
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# variant: (window, softcap, cache dtype or None for q's)
VARIANTS = {"plain": (0, 0.0, None), "window": (256, 0.0, None), "softcap": (0, 50.0, None), "fp8": (0, 0.0, torch.float8_e4m3fn)}
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")


def cpu_flags() -> str:
    """The host's CPU flags among those the kernels use (Linux), else the processor's name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + " ".join(CPU_FLAGS)


def decode_chunks(num_seqs: int, mean_ctx: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """(cached tokens, new tokens) per sequence: decodes with contexts spread ±25% around mean_ctx."""
    spread = mean_ctx // 4
    return [(int(ctx), 1) for ctx in torch.randint(mean_ctx - spread, mean_ctx + spread, (num_seqs,), generator=generator)]


def cases(generator: torch.Generator) -> dict[str, list[tuple[int, int]]]:
    return {
        "decode 64 x ~400": decode_chunks(64, 400, generator),
        "decode 256 x ~600": decode_chunks(256, 600, generator),
        # Two 512-token prefill chunks (one fresh prompt, one continuing after 512 cached) among decodes.
        "mixed 2x512 + 62 dec": [(0, 512), *decode_chunks(31, 400, generator), (512, 512), *decode_chunks(31, 400, generator)],
        "prefill 2000": [(0, 2000)],  # bench/engine.py's lone prompt in one chunk
    }


def build_step(chunks: list[tuple[int, int]], dtype: torch.dtype, device: str, generator: torch.Generator) -> tuple:
    seq_lens = [cached + new for cached, new in chunks]
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 16
    block_ids = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(len(chunks), max(blocks_per_seq), dtype=torch.int32)
    slots, used = [], 0
    for s, ((cached, new), count) in enumerate(zip(chunks, blocks_per_seq, strict=True)):
        table = block_ids[used : used + count]
        used += count
        block_tables[s, :count] = table
        positions = torch.arange(cached, cached + new)
        slots.append(table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE)
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(device, dtype)
    num_tokens = sum(new for _, new in chunks)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator).to(device, dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(device, dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(device, dtype)
    q_lens = torch.tensor([new for _, new in chunks])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(device, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=int(q_lens.max()),
        max_seq_len=max(seq_lens),
        is_decode_only=bool((q_lens == 1).all()),
    )
    return q, k, v, kv_cache[:, 1, 0], kv_cache[:, 1, 1], meta, HEAD_DIM**-0.5


def time_ms(fn: Callable[[], torch.Tensor], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def bench_case(
    step: tuple, backends: dict[str, AttentionFn], device: str, rounds: int, window: int = 0, softcap: float = 0.0
) -> dict[str, dict[str, float]]:
    options = {"window": window, "softcap": softcap}
    reference_cpu = paged_attention_reference(*_to_cpu(step), **options)  # the reference reads host-side lengths
    errors = {name: (fn(*step, **options).float().cpu() - reference_cpu.float()).abs().max().item() for name, fn in backends.items()}
    samples: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(rounds):  # interleaved, so drift in the machine's load hits every backend alike
        for name, attention in backends.items():
            samples[name].append(time_ms(lambda attention=attention: attention(*step, **options), device))
    return {
        name: {"median_ms": statistics.median(times), "min_ms": min(times), "max_abs_error": errors[name]}
        for name, times in samples.items()
    }


def _to_cpu(step: tuple) -> tuple:
    q, k, v, k_cache, v_cache, meta, scale = step
    if q.device.type == "cpu":
        return step
    fields = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in vars(meta).items()}
    cpu_meta = AttentionMetadata(**fields)
    return q.cpu(), k.cpu(), v.cpu(), k_cache.cpu(), v_cache.cpu(), cpu_meta, scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--variants", nargs="*", choices=[v for v in VARIANTS if v != "plain"], default=["window", "softcap", "fp8"])
    parser.add_argument("--json", type=Path, default=Path("build/bench/attention.json"))
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends: dict[str, AttentionFn] = {"reference": paged_attention_reference, "torch": paged_attention_torch}
    if device == "cuda":
        backends["triton"] = paged_attention_triton
    elif cpu_extension.load():
        backends["cpp"] = paged_attention_cpu
        if torch.ops.tandem.prefill_amx_supported(HEAD_DIM, torch.bfloat16, torch.bfloat16):
            # prefill chunks on the vector units, not AMX tiles (bf16: the default's choice measured)
            backends["cpp-vector"] = functools.partial(paged_attention_cpu, prefill_kernel=0)
    results = []
    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} rounds={args.rounds} cpu flags: {cpu_flags()}")
    print(f"{'case':<22} {'dtype':<5} {'backend':<10} {'median ms':>10} {'min ms':>8} {'speedup':>8} {'(by min)':>9} {'max |err|':>10}")
    for dtype_name in args.dtype:
        generator = torch.Generator().manual_seed(0)
        for case, chunks in cases(generator).items():
            step = build_step(chunks, DTYPES[dtype_name], device, generator)
            timings = bench_case(step, backends, device, args.rounds)
            reference = timings["reference"]
            for name, timing in timings.items():
                speedup = reference["median_ms"] / timing["median_ms"]
                speedup_by_min = reference["min_ms"] / timing["min_ms"]
                print(
                    f"{case:<22} {dtype_name:<5} {name:<10} {timing['median_ms']:>10.2f} {timing['min_ms']:>8.2f}"
                    f" {speedup:>7.2f}x {speedup_by_min:>8.2f}x {timing['max_abs_error']:>10.1e}"
                )
                results.append(
                    {"case": case, "dtype": dtype_name, "backend": name, "speedup": speedup, "speedup_by_min": speedup_by_min, **timing}
                )
    variants = bench_variants(args, device, {name: fn for name, fn in backends.items() if name != "reference"}) if args.variants else []
    args.json.parent.mkdir(parents=True, exist_ok=True)
    summary = {"device": device, "threads": torch.get_num_threads(), "cpu_flags": cpu_flags(), "results": results, "variants": variants}
    args.json.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.json}")


def bench_variants(args: argparse.Namespace, device: str, backends: dict[str, AttentionFn]) -> list[dict]:
    """The fast backends on each case with each variant and plainly, interleaved in one run: each
    variant's median against the plain one's (below 1: faster than plain)."""
    results = []
    print(f"\n{'case':<22} {'dtype':<5} {'variant':<8} {'backend':<10} {'median ms':>10} {'min ms':>8} {'vs plain':>9} {'max |err|':>10}")
    for dtype_name in args.dtype:
        generator = torch.Generator().manual_seed(0)
        for case, chunks in cases(generator).items():
            state = generator.get_state()
            plain = None
            for variant in ("plain", *args.variants):
                window, softcap, cache_dtype = VARIANTS[variant]
                generator.set_state(state)  # every variant the same step
                step = build_step(chunks, DTYPES[dtype_name], device, generator)
                if cache_dtype is not None:
                    step = (*step[:3], step[3].to(cache_dtype), step[4].to(cache_dtype), *step[5:])
                timings = bench_case(step, backends, device, args.rounds, window, softcap)
                plain = plain or timings
                for name, timing in timings.items():
                    ratio = timing["median_ms"] / plain[name]["median_ms"]
                    print(
                        f"{case:<22} {dtype_name:<5} {variant:<8} {name:<10} {timing['median_ms']:>10.2f} {timing['min_ms']:>8.2f}"
                        f" {ratio:>8.2f}x {timing['max_abs_error']:>10.1e}"
                    )
                    results.append({"case": case, "dtype": dtype_name, "variant": variant, "backend": name, "vs_plain": ratio, **timing})
    return results


if __name__ == "__main__":
    main()
