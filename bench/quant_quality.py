"""What 8-bit weights and KV caches cost in quality and buy in speed: SmolLM2-135M in the dtype
against each `--against` variant of it, side by side: the same weights kept as int8
(TANDEM_QUANTIZATION=int8, the small model of `tandem up`) or as fp8 e4m3 (TANDEM_QUANTIZATION=fp8,
models/fp8.py); the model's own weights over an fp8 KV cache (`fp8kv`, TANDEM_KV_CACHE_DTYPE=fp8), or
over a bf16 cache under the float32 model (`bf16kv`, TANDEM_KV_CACHE_DTYPE=bf16).

    .venv/bin/python bench/quant_quality.py [--quick] [--threads N] [--against int8,fp8,fp8kv,bf16kv] [--out results.json]

Quality, on fixed inputs:
- greedy agreement: the chat set (tandem.ops.chat_prompts) through the engine, `--new-tokens`
  greedy tokens each: the share of replies identical to the dtype's, and the share of tokens
  written before a reply first differs.
- perplexity of bench/data/perplexity.txt (a short English text shipped here), one forward over
  the whole text, and the share of its positions where both models predict the same next token.

Speed: decode tokens/s at each `--batches` size: that many short chat prompts at once, each
writing `--decode-tokens` tokens, every decode step timed (`--repeats` runs per model, the two
models alternating so that both see the same machine load); tokens/s = batch / step time, for the
median step and the fastest (on a shared machine, the uncontended figure). Also the bytes of the
projection weights. The table ends with the host's CPU flags that the kernels use.
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path

import torch
from common import kv_blocks_for, percentile, resolve_engine, run_timed, set_threads, write_json

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.kernels.metadata import AttentionMetadata, KvCacheShape
from tandem.models.files import Quantization
from tandem.models.fp8 import Fp8Linear
from tandem.models.loader import LoadedModel, load_model, resolve_kv_cache_dtype
from tandem.models.packed import PackedLinear
from tandem.models.quant import Int8Linear
from tandem.ops.chat_prompts import chat_set

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
FULL = dict(prompts=34, new_tokens=32, batches="1,8", decode_tokens=64, repeats=3)
QUICK = dict(prompts=4, new_tokens=8, batches="1,2", decode_tokens=8, repeats=1)
# variant -> (the weights' quantization, the KV cache dtype setting)
VARIANTS: dict[str, tuple[Quantization, str]] = {
    "int8": ("int8", "auto"),
    "fp8": ("fp8", "auto"),
    "fp8kv": ("none", "fp8"),
    "bf16kv": ("none", "bf16"),
}
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")  # what the C++ kernels are built for


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke-test sizes: {QUICK}")
    parser.add_argument("--prompts", type=int, help=f"chat-set conversations for greedy agreement (default {FULL['prompts']}, all)")
    parser.add_argument("--new-tokens", type=int, help=f"greedy tokens per reply (default {FULL['new_tokens']})")
    parser.add_argument("--batches", help=f"decode batch sizes, comma-separated (default {FULL['batches']})")
    parser.add_argument("--decode-tokens", type=int, help=f"tokens each request writes in the speed runs (default {FULL['decode_tokens']})")
    parser.add_argument("--repeats", type=int, help=f"speed runs per model and batch; the best counts (default {FULL['repeats']})")
    parser.add_argument("--text", type=Path, default=TEXT, help="text for perplexity (default bench/data/perplexity.txt)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's, all cores)")
    parser.add_argument(
        "--dtype", choices=("auto", "bf16", "fp32"), default="auto", help="the unquantized model's dtype and int8's activations"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--against",
        default="int8,fp8",
        help=f"the variants compared, comma-separated: {', '.join(VARIANTS)} (bf16kv under fp32 only; default int8,fp8)",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.batches = [int(n) for n in args.batches.split(",")]
    args.against = [v.strip() for v in args.against.split(",")]
    if unknown := [v for v in args.against if v not in VARIANTS]:
        parser.error(f"--against: unknown {unknown} (one or more of {', '.join(VARIANTS)})")
    return args


# -- quality ------------------------------------------------------------------------------------


def greedy_replies(
    loaded: LoadedModel, prompts: list[list[int]], num_tokens: int, kv_cache_dtype: torch.dtype | None
) -> list[tuple[int, ...]]:
    sampling = SamplingOptions(max_tokens=num_tokens, ignore_eos=True)
    blocks = kv_blocks_for((len(p) + num_tokens for p in prompts), EngineConfig.block_size)
    engine = Engine(loaded, EngineConfig(num_kv_blocks=blocks, kv_cache_dtype=kv_cache_dtype))
    timings = run_timed(engine, [Request(f"r{i}", tuple(p), sampling) for i, p in enumerate(prompts)])
    return [timings[f"r{i}"].output_token_ids for i in range(len(prompts))]


def agreement(reference: list[tuple[int, ...]], other: list[tuple[int, ...]]) -> dict:
    """Identical replies, and tokens written before each reply first differs (after that the two
    continue different texts, so later positions say nothing)."""
    num_same_prefix = 0
    for a, b in zip(reference, other, strict=True):
        num_same_prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return {
        "identical_replies": sum(a == b for a, b in zip(reference, other, strict=True)),
        "num_replies": len(reference),
        "tokens_before_first_difference": num_same_prefix / sum(len(a) for a in reference),
    }


@torch.inference_mode()
def sequence_logits(loaded: LoadedModel, token_ids: list[int], kv_cache_dtype: torch.dtype | None) -> torch.Tensor:
    """(len, vocab) float32 logits of one sequence, one forward over a fresh paged KV cache."""
    config, block_size = loaded.config, EngineConfig.block_size
    num_blocks = -(-len(token_ids) // block_size)
    weight = loaded.model.model.embed_tokens.weight
    shape = KvCacheShape(num_blocks, config.num_layers, block_size, config.num_kv_heads, config.head_dim)
    kv_cache = torch.zeros(shape.as_tuple(), dtype=kv_cache_dtype or weight.dtype, device=weight.device)
    length = len(token_ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(length, device=weight.device),
        query_start_loc=torch.tensor([0, length], dtype=torch.int32, device=weight.device),
        seq_lens=torch.tensor([length], dtype=torch.int32, device=weight.device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=weight.device)[None],
        max_query_len=length,
        max_seq_len=length,
        is_decode_only=length == 1,
    )
    ids = torch.tensor(token_ids, device=weight.device)
    hidden = loaded.model(ids, torch.arange(length, device=weight.device), kv_cache, meta)
    return loaded.model.compute_logits(hidden)


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    targets = torch.tensor(token_ids[1:], device=logits.device)
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], targets).item())


# -- speed --------------------------------------------------------------------------------------


def decode_step_times_s(loaded: LoadedModel, prompts: list[list[int]], num_tokens: int, kv_cache_dtype: torch.dtype | None) -> list[float]:
    """The time of every engine step after the prompts are read, while all of them decode together."""
    sampling = SamplingOptions(max_tokens=num_tokens, ignore_eos=True)
    blocks = kv_blocks_for((len(p) + num_tokens for p in prompts), EngineConfig.block_size)
    engine = Engine(loaded, EngineConfig(num_kv_blocks=blocks, kv_cache_dtype=kv_cache_dtype))
    for i, prompt in enumerate(prompts):
        engine.add(Request(f"r{i}", tuple(prompt), sampling))
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill steps, untimed
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    times_s = []
    for _ in range(num_tokens - 1):
        start_s = time.perf_counter()
        outputs = engine.step()
        times_s.append(time.perf_counter() - start_s)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"a decode step returned {len(outputs)} outputs for {len(prompts)} requests")
    if engine.has_work():
        raise RuntimeError("requests still running after their last token")
    return times_s


def is_quantized(module: torch.nn.Module) -> bool:
    """An 8-bit projection: quant.py's Int8Linear, one packed for the CPU kernel (models/packed.py), or fp8.py's Fp8Linear."""
    return isinstance(module, Int8Linear | Fp8Linear) or (isinstance(module, PackedLinear) and module.scale is not None)


def cpu_flags() -> str:
    """The host's CPU flags among those the kernels use (Linux), else the processor's name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + " ".join(CPU_FLAGS)


def projection_bytes(loaded: LoadedModel) -> int:
    """Bytes of the attention and MLP projections (what 8-bit weights shrink), scales included."""
    total = 0
    for layer in loaded.model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            total += sum(t.nbytes for t in (*module.parameters(), *module.buffers()))
    return total


def main() -> None:
    args = parse_args()
    bench_start_s = time.perf_counter()
    num_threads = set_threads(args.threads)
    device, dtype = resolve_engine(args.device, args.dtype)
    attention = select_attention(device)
    base = load_model(None, dtype, device, attention)
    models, kv_dtypes = {"dtype": base}, {"dtype": None}
    for name in args.against:
        quantization, kv_setting = VARIANTS[name]
        models[name] = base if quantization == "none" else load_model(None, dtype, device, attention, quantization)
        kv_dtypes[name] = None if kv_setting == "auto" else resolve_kv_cache_dtype(kv_setting, dtype, device, f"--against {name}")  # type: ignore[arg-type]
        assert quantization == "none" or any(is_quantized(m) for m in models[name].model.modules())
    tokenizer = models["dtype"].tokenizer
    conversations = chat_set()[: args.prompts]
    prompts = [tokenizer.encode_chat(messages) for messages in conversations]
    text_ids = tokenizer.encode(args.text.read_text())

    replies = {name: greedy_replies(loaded, prompts, args.new_tokens, kv_dtypes[name]) for name, loaded in models.items()}
    logits = {name: sequence_logits(loaded, text_ids, kv_dtypes[name]) for name, loaded in models.items()}
    top1 = {name: (logits["dtype"].argmax(dim=-1) == logits[name].argmax(dim=-1)).float().mean().item() for name in args.against}

    short = sorted(prompts, key=len)
    for name, loaded in models.items():  # warm-up: first calls allocate and pick kernels
        decode_step_times_s(loaded, short[:2], 4, kv_dtypes[name])
    step_times_s: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in models}
    for batch in args.batches:
        batch_prompts = (short * batch)[:batch]
        for _ in range(args.repeats):
            for name, loaded in models.items():  # alternating: both see the same load
                step_times_s[name][batch] += decode_step_times_s(loaded, batch_prompts, args.decode_tokens, kv_dtypes[name])

    def decode_speed(name: str) -> dict[str, dict[str, float]]:
        return {
            str(b): {
                "tokens_per_s_median_step": b / percentile(step_times_s[name][b], 50),
                "tokens_per_s_fastest_step": b / min(step_times_s[name][b]),
                "step_ms_median": 1e3 * percentile(step_times_s[name][b], 50),
                "step_ms_fastest": 1e3 * min(step_times_s[name][b]),
            }
            for b in args.batches
        }

    result = {
        "models": {
            name: {
                "quantization": "none" if name == "dtype" else VARIANTS[name][0],
                "kv_cache_dtype": str(kv_dtypes[name] or dtype).removeprefix("torch."),
                "perplexity": perplexity(logits[name], text_ids),
                "projection_bytes": projection_bytes(loaded),
                "decode": decode_speed(name),
            }
            for name, loaded in models.items()
        },
        "against": args.against,
        "greedy_agreement": {name: agreement(replies["dtype"], replies[name]) for name in args.against},
        "text_top1_agreement": top1,
        "workload": {
            "num_prompts": len(prompts),
            "new_tokens": args.new_tokens,
            "text": str(args.text),
            "text_tokens": len(text_ids),
            "batches": args.batches,
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
        },
        "env": {
            "dtype": str(dtype).removeprefix("torch."),
            "device": device,
            "threads": num_threads,
            "torch": torch.__version__,
            "machine": platform.machine(),
            "cpu_flags": cpu_flags(),
            "quick": args.quick,
        },
    }
    result["elapsed_s"] = time.perf_counter() - bench_start_s
    print_table(result)
    write_json(args.out, result)


def print_table(r: dict) -> None:
    env, w, m = r["env"], r["workload"], r["models"]
    names = ["dtype", *r["against"]]
    print(
        f"\n{', '.join(r['against'])} vs {env['dtype']}: SmolLM2-135M-Instruct on {env['device']}, torch threads={env['threads']}, torch {env['torch']}"
    )
    width = 40 + 12 * len(names)
    print("-" * width)
    print(f"  {'':<40}" + "".join(f"{env['dtype'] if n == 'dtype' else n:>12}" for n in names))

    def row(label: str, cells: list[str]) -> None:
        print(f"  {label:<40}" + "".join(f"{c:>12}" for c in cells))

    row("projection weights MB", [f"{m[n]['projection_bytes'] / 1e6:.1f}" for n in names])
    row(f"perplexity ({w['text_tokens']} tokens of text)", [f"{m[n]['perplexity']:.3f}" for n in names])
    row("  vs the dtype's", ["", *(f"{100 * (m[n]['perplexity'] / m['dtype']['perplexity'] - 1):+.2f}%" for n in names[1:])])
    for batch in w["batches"]:
        for kind in ("median", "fastest"):
            key = f"tokens_per_s_{kind}_step"
            row(f"decode tokens/s, batch {batch} ({kind} step)", [f"{m[n]['decode'][str(batch)][key]:.1f}" for n in names])
    print(f"agreement with the {env['dtype']} model (the KV variants: its weights over their own cache)")
    g = r["greedy_agreement"]
    row(
        f"identical greedy replies ({w['new_tokens']} tokens)",
        ["", *(f"{g[n]['identical_replies']} / {g[n]['num_replies']}" for n in names[1:])],
    )
    row("tokens before a reply first differs", ["", *(f"{100 * g[n]['tokens_before_first_difference']:.1f}%" for n in names[1:])])
    row("same next-token prediction on the text", ["", *(f"{100 * r['text_top1_agreement'][n]:.1f}%" for n in names[1:])])
    print("-" * width)
    print(
        f"greedy replies: the first {w['num_prompts']} chat-set conversations; decode: batch x short chat prompts, "
        f"{w['decode_tokens']} tokens each,\n{w['repeats']} runs per model alternating; tokens/s = batch / step time "
        f"(on a shared machine the fastest step is the\nuncontended figure); CPU flags: {env['cpu_flags']}; bench took {r['elapsed_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
