"""A checkpoint with Llama-3-70B's layer shapes, loaded by tensor-parallel ranks: each rank's peak
resident memory against its share of the weights.

    python bench/big_model.py [--tensor-parallel-size 4] [--dtype bf16|fp32] [--sequential] [--greedy]
        [--layers 2] [--hidden 8192] [--heads 64] [--kv-heads 8] [--intermediate 28672]
        [--vocab 32000] [--checkpoint DIR] [--out results.json]

The checkpoint (random bf16 weights, one safetensors file per layer and one for the rest, as
Hugging Face shards a big model) is written to --checkpoint, or a temporary folder. Then N
processes, one per rank, join a gloo group (tensor_parallel.join, a file:// rendezvous) and each
calls load_model for its shard on the CPU. A rank's figures:
- peak: VmHWM of /proc/self/status after loading; baseline: VmHWM before (the interpreter, torch
  and the group: the same whatever the model's size);
- share: the bytes of the rank's model (its parameters and buffers in the serving dtype);
- (peak - baseline) / share: what loading cost over what it had to hold (target <= 1.3x), and
  peak / share, which for a model of two layers is mostly the baseline.
--sequential: the ranks load one after another (a barrier between turns), so one rank's load is
not slowed by the others' on a small machine, and only one rank reads at a time.

--greedy: the same greedy tokens at TP=N as at TP=1? First one process loads the whole model
alone (TP=1) and an engine on it answers --greedy-prompts seeded random-token prompts of 8 tokens,
--greedy-tokens tokens each (ignore_eos); it ends, freeing its memory, and then the N ranks load
and rank 0's engine answers the same prompts while the others follow its steps
(engine/rank_follower.py). Both answers and their generate times are reported; in float32 they are
expected identical (the all-reduce sums the ranks' partial products in float32 in rank order: not
one rank's order, but far from a tie between random logits). The peaks are read before the engine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import cpu_host, cpu_line, mark, write_json
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.rank_follower import follow
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.models.config import ModelConfig
from tandem.models.loader import LoadedModel, load_model
from tandem.models.safetensors_weights import SHARD_INDEX
from tandem.models.tensor_parallel import TensorParallel, join

TARGET_RATIO = 1.3  # (peak - baseline) / share
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=4)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the serving dtype (the checkpoint is bf16)")
    parser.add_argument("--sequential", action="store_true", help="ranks load one after another")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=28672)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--greedy", action="store_true", help="compare greedy tokens at TP=N with TP=1's (run first)")
    parser.add_argument("--greedy-prompts", type=int, default=3, help="random-token prompts of 8 tokens (default 3)")
    parser.add_argument("--greedy-tokens", type=int, default=8, help="greedy tokens each (default 8)")
    parser.add_argument("--threads", type=int, help="torch threads per rank (default: torch's)")
    parser.add_argument("--checkpoint", type=Path, help="write (or reuse, when its config matches) the checkpoint here")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    return parser.parse_args()


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


# -- the checkpoint -----------------------------------------------------------------------------


def layer_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    p, h = f"model.layers.{layer}", config.hidden_size
    return {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
        f"{p}.self_attn.q_proj.weight": (config.q_size, h),
        f"{p}.self_attn.k_proj.weight": (config.kv_size, h),
        f"{p}.self_attn.v_proj.weight": (config.kv_size, h),
        f"{p}.self_attn.o_proj.weight": (h, config.q_size),
        f"{p}.mlp.gate_proj.weight": (config.intermediate_size, h),
        f"{p}.mlp.up_proj.weight": (config.intermediate_size, h),
        f"{p}.mlp.down_proj.weight": (h, config.intermediate_size),
    }


def write_checkpoint(folder: Path, config: ModelConfig, seed: int = 0) -> int:
    """Random bf16 weights, one file per layer and one for the rest; returns the weights' bytes.
    A folder whose config.json is this config's already is reused."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {f"model-layer-{i:03d}.safetensors": layer_shapes(config, i) for i in range(config.num_layers)}
    h = config.hidden_size
    files["model-rest.safetensors"] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "lm_head.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    num_bytes = 2 * sum(torch.Size(shape).numel() for shapes in files.values() for shape in shapes.values())
    hf_config = json.dumps(config.to_hf(), indent=2)
    if (folder / "config.json").is_file() and (folder / "config.json").read_text() == hf_config:
        return num_bytes
    generator = torch.Generator().manual_seed(seed)
    for file, shapes in files.items():
        tensors = {}
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:  # std 1/sqrt(fan_in), drawn in bf16 (no float32 copy of a 470 MB matrix)
                tensors[name] = torch.randn(shape, generator=generator, dtype=torch.bfloat16).mul_(shape[-1] ** -0.5)
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
    weight_map = {name: file for file, shapes in files.items() for name in shapes}
    (folder / SHARD_INDEX).write_text(json.dumps({"metadata": {"total_size": num_bytes}, "weight_map": weight_map}))
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    BackendTokenizer(models.WordLevel(vocab=vocab, unk_token="w0")).save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(hf_config)  # last: a folder with it is whole
    return num_bytes


# -- one rank -----------------------------------------------------------------------------------


def vm_kib(field: str) -> int:
    """A VmHWM / VmRSS line of /proc/self/status, in KiB."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def load_rank(folder: Path, dtype: torch.dtype, tp: TensorParallel) -> tuple[LoadedModel, dict[str, Any]]:
    """This rank's model and its figures: peak memory against its share, load time."""
    attention = select_attention("cpu")  # its kernels loaded before the baseline
    baseline_kib = vm_kib("VmHWM")
    start_s = time.perf_counter()
    loaded = load_model(folder, dtype, "cpu", attention, pack=False, tp=tp)
    load_s = time.perf_counter() - start_s
    peak_kib = vm_kib("VmHWM")
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    share = sum(t.numel() * t.element_size() for t in tensors)
    return loaded, {
        "rank": tp.rank,
        "loaded": True,
        "load_s": load_s,
        "share_bytes": share,
        "baseline_bytes": 1024 * baseline_kib,
        "peak_bytes": 1024 * peak_kib,
        "ratio": 1024 * peak_kib / share,
        "ratio_over_baseline": 1024 * (peak_kib - baseline_kib) / share,
    }


def greedy_prompts(args: argparse.Namespace, seed: int = 0) -> list[list[int]]:
    """Seeded random token ids, 8 a prompt, clear of the special ids below 3."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, args.vocab, (args.greedy_prompts, 8), generator=generator).tolist()


def greedy(loaded: LoadedModel, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], float]:
    """On rank 0: the greedy answers of an engine on `loaded` (the other ranks follow its steps) and
    the seconds generate took."""
    blocks_each = -(-(8 + num_tokens) // EngineConfig.block_size)
    engine = Engine(loaded, EngineConfig(num_kv_blocks=len(prompts) * blocks_each + 8, max_num_seqs=len(prompts)))
    sampling = SamplingOptions(max_tokens=num_tokens, ignore_eos=True)
    requests = [Request(f"g{i}", tuple(prompt), sampling) for i, prompt in enumerate(prompts)]
    start_s = time.perf_counter()
    streams = engine.generate(requests)
    elapsed_s = time.perf_counter() - start_s
    engine.close()  # the other ranks' follow returns
    return [[t for output in streams[r.request_id] for t in output.new_token_ids] for r in requests], elapsed_s


def rank_main(
    rank: int,
    size: int,
    rendezvous: str,
    folder: Path,
    dtype_name: str,
    threads: int | None,
    is_sequential: bool,
    prompts: list[list[int]],
    num_tokens: int,
    reports: Any,
) -> None:
    """Loads this rank's shard and reports its figures; with `prompts`, then answers them (rank 0)
    or follows rank 0's engine (the others)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if threads:
        torch.set_num_threads(threads)
    tp = join(rank, size, rendezvous, "cpu")
    is_loaded = False
    try:
        loaded = None
        for turn in range(size if is_sequential else 1):
            if not is_sequential or turn == rank:
                loaded, figures = load_rank(folder, DTYPES[dtype_name], tp)
                reports.put(figures)
                is_loaded = True
            if size > 1:
                dist.barrier()
        assert loaded is not None
        if prompts and rank == 0:
            answers, elapsed_s = greedy(loaded, prompts, num_tokens)
            reports.put({"greedy_tokens": answers, "generate_s": elapsed_s})
        elif prompts:
            follow(loaded)
    except Exception as exc:  # the parent reports it; a rank that dies silently would leave it waiting
        error = f"{type(exc).__name__}: {exc}"
        reports.put({"greedy_tokens": None, "error": error} if is_loaded else {"rank": rank, "loaded": False, "error": error})
        raise
    finally:
        tp.close()


def run_ranks(folder: Path, args: argparse.Namespace, size: int, prompts: list[list[int]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every rank's figures, and rank 0's greedy answers ({} without prompts, or when it failed)."""
    spawn = multiprocessing.get_context("spawn")  # fresh interpreters: each VmHWM is its own
    reports = spawn.Queue()
    with tempfile.TemporaryDirectory(prefix="tandem-big-model-") as scratch:
        rendezvous = f"file://{scratch}/rendezvous"
        procs = [
            spawn.Process(
                target=rank_main,
                args=(r, size, rendezvous, folder, args.dtype, args.threads, args.sequential, prompts, args.greedy_tokens, reports),
            )
            for r in range(size)
        ]
        for proc in procs:
            proc.start()
        results: list[dict[str, Any]] = []
        answers: dict[str, Any] = {}
        deadline = time.monotonic() + 3600
        while (len(results) < size or (prompts and not answers)) and time.monotonic() < deadline:
            try:
                report = reports.get(timeout=5)
            except queue.Empty:  # is every rank still there?
                if any(p.exitcode not in (None, 0) for p in procs) or all(p.exitcode is not None for p in procs):
                    break
                continue
            if "greedy_tokens" in report:
                answers = report
            else:
                results.append(report)
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    missing = sorted(set(range(size)) - {r["rank"] for r in results})
    results += [{"rank": r, "loaded": False, "error": "the rank ended without a report"} for r in missing]
    return sorted(results, key=lambda r: r["rank"]), answers


def compare_greedy(prompts: list[list[int]], one: dict[str, Any], many: dict[str, Any]) -> dict[str, Any]:
    """TP=1's answers against TP=N's."""
    tokens_one, tokens_many = one.get("greedy_tokens"), many.get("greedy_tokens")
    return {
        "errors": [side["error"] for side in (one, many) if "error" in side],
        "prompts": prompts,
        "tokens_tp1": tokens_one,
        "tokens_tp": tokens_many,
        "generate_s_tp1": one.get("generate_s"),
        "generate_s_tp": many.get("generate_s"),
        "is_identical": tokens_one is not None and tokens_one == tokens_many,
        "num_identical": sum(a == b for a, b in zip(tokens_one or [], tokens_many or [], strict=False)),
    }


# -- the report ---------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    config = model_config(args)
    with tempfile.TemporaryDirectory(prefix="tandem-big-checkpoint-") as scratch:
        folder = args.checkpoint or Path(scratch)
        start_s = time.perf_counter()
        checkpoint_bytes = write_checkpoint(folder, config)
        write_s = time.perf_counter() - start_s
        prompts = greedy_prompts(args) if args.greedy else []
        # TP=1 first, alone, its process ended (its memory freed) before the N ranks load
        tp1_ranks, answers_one = run_ranks(folder, args, 1, prompts) if prompts else ([], {})
        ranks, answers = run_ranks(folder, args, args.tensor_parallel_size, prompts)
    loaded = [r for r in ranks if r["loaded"]]
    worst = max((r["ratio_over_baseline"] for r in loaded), default=float("inf"))
    result = {
        "ranks": ranks,
        "all_loaded": len(loaded) == len(ranks),
        "max_ratio_over_baseline": worst,
        "max_ratio": max((r["ratio"] for r in loaded), default=float("inf")),
        "target": {"ratio_over_baseline": TARGET_RATIO, "met": len(loaded) == len(ranks) and worst <= TARGET_RATIO},
        "greedy": compare_greedy(prompts, answers_one, answers) | {"tp1_load": tp1_ranks[0]} if prompts else None,
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_write_s": write_s,
        "config": config.to_hf(),
        "env": {
            "tensor_parallel_size": args.tensor_parallel_size,
            "dtype": args.dtype,
            "sequential": args.sequential,
            "threads": args.threads,
            "torch": torch.__version__,
            "cpu": cpu_host(),
        },
    }
    print_table(result)
    write_json(args.out, result)


def print_table(r: dict[str, Any]) -> None:
    c, env = r["config"], r["env"]
    gib = 2**30
    print(
        f"\nLoading by rank: {c['num_hidden_layers']} layers of hidden {c['hidden_size']}, {c['num_attention_heads']} heads "
        f"({c['num_key_value_heads']} KV), MLP {c['intermediate_size']}, vocab {c['vocab_size']}; "
        f"{r['checkpoint_bytes'] / gib:.2f} GiB bf16 checkpoint, served {env['dtype']}, TP={env['tensor_parallel_size']}"
        f"{', ranks one at a time' if env['sequential'] else ''}"
    )
    print(cpu_line(env["cpu"]))
    print("-" * 86)
    print(f"  {'rank':<6}{'share GiB':>10}{'baseline GiB':>14}{'peak GiB':>10}{'peak/share':>12}{'(peak-base)/share':>19}{'load s':>9}")
    for rank in r["ranks"]:
        if not rank["loaded"]:
            print(f"  {rank['rank']:<6}failed: {rank['error']}")
            continue
        print(
            f"  {rank['rank']:<6}{rank['share_bytes'] / gib:>10.3f}{rank['baseline_bytes'] / gib:>14.3f}{rank['peak_bytes'] / gib:>10.3f}"
            f"{rank['ratio']:>11.2f}x{rank['ratio_over_baseline']:>18.2f}x{rank['load_s']:>9.1f}"
        )
    target = r["target"]
    print(
        f"  worst (peak - baseline) / share {r['max_ratio_over_baseline']:.2f}x, target <= {target['ratio_over_baseline']}x  {mark(target['met'])}"
    )
    if (g := r["greedy"]) is not None:
        n = env["tensor_parallel_size"]
        times = f"generate {g['generate_s_tp1'] or float('nan'):.1f} s at TP=1, {g['generate_s_tp'] or float('nan'):.1f} s at TP={n}"
        print(
            f"  greedy, {len(g['prompts'])} random-token prompts: TP={n} answers {g['num_identical']}/{len(g['prompts'])} "
            f"as TP=1 does ({times})  {mark(g['is_identical'])}"
        )
    print("-" * 86)


if __name__ == "__main__":
    main()
