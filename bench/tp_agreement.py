"""Greedy answers of the embedded SmolLM2-135M over 3 tensor-parallel ranks against one rank, in
float32 and in bfloat16: how often they agree, and where and why they part.

    .venv/bin/python bench/tp_agreement.py [--prompts 16] [--max-tokens 32] [--tensor-parallel-size 3]
        [--dtypes fp32,bf16] [--threads N] [--out results.json]

Each dtype: the fixed chat prompts below (the first --prompts of them) at once on an engine of one
rank, then on an engine over N ranks (rank 0 here, the others processes of their own: worker/
engine_ranks.py, gloo; max(1, threads // N) torch threads each), each answer exactly --max-tokens
greedy tokens (ignore_eos). Per dtype: the share of answers identical token for token, and for
those that differ the mean position of the first differing token. At each first divergence, the
one-rank model's logits for that context (one forward of the prompt and the common prefix, outside
the engine) give the gap between its two likeliest tokens, and the float32 model's gap in the same
context beside it: a flip where the two likeliest tokens nearly tie is rounding (the all-reduce
sums partial products in another order than one rank's matmul), not a wrong shard. A bfloat16
model's logits come in steps of bfloat16's precision (0.125 between 16 and 32), so a gap of 0 there
is a tie, which argmax breaks by the lower token id.

Expected: float32 identical (tests/integration/test_tensor_parallel.py
asserts it on 3 prompts); bfloat16 is measured, not asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from common import cpu_host, cpu_line, set_threads, write_json

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels.metadata import BLOCK_SIZE, AttentionMetadata
from tandem.models.files import open_model
from tandem.models.loader import LoadedModel
from tandem.worker.engine_ranks import PeerRanks
from tandem.worker.engine_spec import EngineSpec, build_engine

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What does a compiler do?",
    "Name two planets with rings.",
    "How do bees make honey?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Suggest a name for a small black cat.",
    "Explain what a neural network is in one sentence.",
    "What should I pack for a day hike?",
    "Who wrote Romeo and Juliet?",
    "Describe the taste of a lemon.",
    "How many legs does a spider have?",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_PROMPT_TOKENS = 128  # the KV cache is sized for prompts up to this (the template's and the question's tokens)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"the first N of the {len(PROMPTS)} fixed prompts")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens of each answer (default 32)")
    parser.add_argument("--tensor-parallel-size", type=int, default=3, help="ranks against one (SmolLM2 splits over 3; default 3)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16 (default both)")
    parser.add_argument("--threads", type=int, help="torch threads in all (default: torch's, all cores); each rank gets threads // N")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must lie in 1..{len(PROMPTS)}")
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    if unknown := set(args.dtypes) - set(DTYPES):
        parser.error(f"--dtypes: unknown {sorted(unknown)} (fp32, bf16)")
    return args


def greedy_answers(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sampling = SamplingOptions(max_tokens=max_tokens, ignore_eos=True)
    requests = [Request(f"p{i}", tuple(prompt), sampling) for i, prompt in enumerate(prompts)]
    streams = engine.generate(requests)
    return [[token for output in streams[r.request_id] for token in output.new_token_ids] for r in requests]


def tensor_parallel_answers(spec: EngineSpec, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """The answers of an engine over spec.tensor_parallel_size ranks, and the seconds they took
    (not the group's start nor its loading)."""
    peers = PeerRanks.start(spec)
    try:
        engine = build_engine(peers.spec)
        start_s = time.perf_counter()
        answers = greedy_answers(engine, prompts, max_tokens)
        elapsed_s = time.perf_counter() - start_s
    except BaseException:
        peers.kill()  # a rank may wait in a collective that will never complete
        raise
    engine.close()
    engine.loaded.model.tp.close()
    peers.stop()
    return answers, elapsed_s


@torch.inference_mode()
def next_token_logits(loaded: LoadedModel, token_ids: Sequence[int]) -> torch.Tensor:
    """(vocab_size,) float32 logits after `token_ids`, one prefill of them on a KV cache of their own
    (a one-rank model)."""
    model, config = loaded.model, loaded.model.config
    parameter = next(model.parameters())
    n, num_blocks = len(token_ids), -(-len(token_ids) // BLOCK_SIZE)
    kv_cache = torch.zeros((num_blocks, config.num_layers, 2, BLOCK_SIZE, config.num_kv_heads, config.head_dim), dtype=parameter.dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=n,
        is_decode_only=n == 1,
    )
    hidden = model(torch.tensor(list(token_ids), dtype=torch.int64), torch.arange(n, dtype=torch.int64), kv_cache, meta)
    return model.compute_logits(hidden[-1:])[0].float()


def divergence(prompt: list[int], one: list[int], many: list[int], loaded: LoadedModel, fp32: LoadedModel | None) -> dict[str, Any] | None:
    """Where `many` first parts from `one` (None: identical), with the one-rank logits there."""
    position = next((i for i, (a, b) in enumerate(zip(one, many, strict=True)) if a != b), None)
    if position is None:
        return None
    context = prompt + one[:position]
    logits = next_token_logits(loaded, context)
    top2 = torch.topk(logits, 2)
    result = {
        "position": position,
        "token_one_rank": one[position],
        "token_tensor_parallel": many[position],
        "top2_tokens": top2.indices.tolist(),
        "top2_logits": top2.values.tolist(),
        "top2_gap": float(top2.values[0] - top2.values[1]),
        "tensor_parallel_token_logit": float(logits[many[position]]),
        "forward_picks_one_rank_token": int(top2.indices[0]) == one[position],
        "fp32_top2_gap": None,
    }
    if fp32 is not None:
        top2_fp32 = torch.topk(next_token_logits(fp32, context), 2)
        result["fp32_top2_gap"] = float(top2_fp32.values[0] - top2_fp32.values[1])
    return result


def measure(name: str, texts: list[str], args: argparse.Namespace, threads: int, fp32: LoadedModel | None) -> tuple[dict, LoadedModel]:
    """One dtype: the one-rank answers, the tensor-parallel ones, and each divergence; and the
    one-rank model (float32's gives the later dtypes' fp32 gaps)."""
    size = args.tensor_parallel_size
    num_blocks = len(texts) * -(-(MAX_PROMPT_TOKENS + args.max_tokens) // BLOCK_SIZE) + 16
    config = EngineConfig(num_kv_blocks=num_blocks, max_num_seqs=len(texts))
    spec = EngineSpec(open_model(None), "cpu", DTYPES[name], config, threads)
    one = build_engine(spec)
    tokenizer = one.loaded.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]
    if max(map(len, prompts)) > MAX_PROMPT_TOKENS:
        raise SystemExit(f"a prompt of {max(map(len, prompts))} tokens: MAX_PROMPT_TOKENS is {MAX_PROMPT_TOKENS}")
    start_s = time.perf_counter()
    answers_one = greedy_answers(one, prompts, args.max_tokens)
    one_s = time.perf_counter() - start_s
    spec_many = dataclasses.replace(spec, tensor_parallel_size=size, torch_threads=max(1, threads // size))
    answers_many, many_s = tensor_parallel_answers(spec_many, prompts, args.max_tokens)
    torch.set_num_threads(threads)  # load_rank set rank 0's share
    rows: list[dict[str, Any]] = []
    for text, prompt, a, b in zip(texts, prompts, answers_one, answers_many, strict=True):
        split = divergence(prompt, a, b, one.loaded, fp32)
        rows.append({"prompt": text, "is_identical": split is None, "divergence": split, "answer_one_rank": tokenizer.decode(a)})
        if split is not None:
            rows[-1]["answer_tensor_parallel"] = tokenizer.decode(b)
            split["tokens"] = [tokenizer.decode([split["token_one_rank"]]), tokenizer.decode([split["token_tensor_parallel"]])]
    splits = [row["divergence"] for row in rows if row["divergence"] is not None]
    return {
        "num_prompts": len(rows),
        "num_identical": len(rows) - len(splits),
        "identical_share": (len(rows) - len(splits)) / len(rows),
        "mean_first_divergence": statistics.fmean(d["position"] for d in splits) if splits else None,
        "mean_top2_gap_at_divergence": statistics.fmean(d["top2_gap"] for d in splits) if splits else None,
        "one_rank_s": one_s,
        "tensor_parallel_s": many_s,
        "prompts": rows,
    }, one.loaded


def main() -> None:
    args = parse_args()
    start_s = time.perf_counter()
    threads = set_threads(args.threads)
    texts = list(PROMPTS[: args.prompts])
    by_dtype: dict[str, dict] = {}
    fp32: LoadedModel | None = None
    for name in sorted(args.dtypes, key=lambda d: d != "fp32"):  # float32 first: its model gives the others' fp32 gaps
        by_dtype[name], loaded = measure(name, texts, args, threads, fp32)
        if name == "fp32":
            fp32 = loaded
        del loaded
    result = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "dtypes": by_dtype,
        "num_prompts": len(texts),
        "max_tokens": args.max_tokens,
        "env": {
            "threads": threads,
            "threads_per_rank": max(1, threads // args.tensor_parallel_size),
            "torch": torch.__version__,
            "cpu": cpu_host(),
        },
    }
    result["elapsed_s"] = time.perf_counter() - start_s
    print_table(result)
    write_json(args.out, result)


def print_table(r: dict[str, Any]) -> None:
    size, env = r["tensor_parallel_size"], r["env"]
    print(
        f"\nGreedy agreement, SmolLM2-135M-Instruct over {size} ranks against one: {r['num_prompts']} chat prompts, "
        f"{r['max_tokens']} tokens each; torch threads {env['threads']} (one rank), {env['threads_per_rank']} per rank (TP={size})"
    )
    print(cpu_line(env["cpu"]))
    print("-" * 86)
    print(f"  {'dtype':<7}{'identical':>12}{'mean first divergence':>24}{'mean top-2 gap there':>22}{'1 rank s':>10}{f'TP={size} s':>10}")
    for name, d in r["dtypes"].items():
        position = "-" if d["mean_first_divergence"] is None else f"token {d['mean_first_divergence']:.1f}"
        gap = "-" if d["mean_top2_gap_at_divergence"] is None else f"{d['mean_top2_gap_at_divergence']:.3f}"
        identical = f"{d['num_identical']}/{d['num_prompts']} {100 * d['identical_share']:.0f}%"
        print(f"  {name:<7}{identical:>12}{position:>24}{gap:>22}{d['one_rank_s']:>10.1f}{d['tensor_parallel_s']:>10.1f}")
    for name, d in r["dtypes"].items():
        for row in d["prompts"]:
            split = row["divergence"]
            if split is None:
                continue
            fp32 = "" if split["fp32_top2_gap"] is None else f", fp32 gap {split['fp32_top2_gap']:.3f}"
            print(
                f"  {name} {row['prompt']!r}: token {split['position']}, one rank {split['tokens'][0]!r} / TP {split['tokens'][1]!r}; "
                f"top-2 {split['top2_logits'][0]:.2f} vs {split['top2_logits'][1]:.2f} (gap {split['top2_gap']:.3f}{fp32})"
            )
    print("-" * 86)
    print(f"float32 is expected identical; the other dtypes are measured, not judged. bench took {r['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
