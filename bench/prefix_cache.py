"""Prefix cache: turn-2 TTFT of a long conversation against the cold TTFT of the same prompt.

    .venv/bin/python bench/prefix_cache.py [--quick] [--threads N] [--out results.json]

Turn 1 sends a ~2,000-token history (seeded user and assistant messages, ending with a user one)
and the engine writes its reply. Turn 2 is the same conversation with that reply and a 20-token
new message, chat-templated again from the messages, as the chat service builds it. Its TTFT on
the engine that served turn 1 (history and reply in the prefix cache) is compared with the TTFT
of the identical prompt on a fresh engine, in the same run, interleaved over a few repeats with
a different new message each time. Target: warm <= 10% of cold (information, not an exit code).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from common import load_ours, mark, message_text, resolve_engine, run_timed, set_threads, write_json

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.models.loader import LoadedModel
from tandem.models.tokenizer import Tokenizer

TARGET_WARM_OVER_COLD = 0.10
FULL = dict(history_tokens=2000, reply_tokens=32, repeats=3)
QUICK = dict(history_tokens=300, reply_tokens=8, repeats=1)
KV_CACHE_MIB = 128  # ~5,700 tokens of SmolLM2 bf16 KV: the conversation with room to spare


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke-test sizes: {QUICK}")
    parser.add_argument("--history-tokens", type=int, help=f"turn-1 prompt length (default {FULL['history_tokens']})")
    parser.add_argument("--new-tokens", type=int, default=20, help="tokens of the turn-2 user message")
    parser.add_argument("--reply-tokens", type=int, help=f"most tokens of the turn-1 reply (default {FULL['reply_tokens']})")
    parser.add_argument("--repeats", type=int, help=f"cold/warm pairs, median reported (default {FULL['repeats']})")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's, all cores)")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto (the default): the GPU when torch sees one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def history(tokenizer: Tokenizer, rng: random.Random, num_tokens: int) -> list[dict[str, str]]:
    """User and assistant turns, ending with a user turn, about `num_tokens` once templated."""
    messages: list[dict[str, str]] = []
    while True:
        remaining = num_tokens - len(tokenizer.encode_chat(messages + [{"role": "user", "content": ""}]))
        if remaining <= 200:
            messages.append({"role": "user", "content": message_text(rng, tokenizer, max(1, remaining))})
            return messages
        messages.append({"role": "user", "content": message_text(rng, tokenizer, rng.randint(60, 160))})
        messages.append({"role": "assistant", "content": message_text(rng, tokenizer, rng.randint(80, 200))})


def exact_tokens(rng: random.Random, tokenizer: Tokenizer, num_tokens: int) -> str:
    """The longest run of whole words from seeded prose that stays within `num_tokens` tokens."""
    words = message_text(rng, tokenizer, 4 * num_tokens).split()
    while len(tokenizer.encode(" ".join(words))) > num_tokens:
        words.pop()
    return " ".join(words)


def ttft(engine: Engine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """(TTFT ms, prompt tokens served from the prefix cache) of one request writing one token."""
    timing = run_timed(engine, [Request(request_id, tuple(prompt), SamplingOptions(max_tokens=1))])[request_id]
    return timing.ttft_ms, timing.num_cached_tokens


def fresh_engine(loaded: LoadedModel) -> Engine:
    return Engine(loaded, EngineConfig(kv_cache_mib=KV_CACHE_MIB))


def main() -> None:
    args = parse_args()
    bench_start_s = time.perf_counter()
    num_threads = set_threads(args.threads)
    device, dtype = resolve_engine(args.device, args.dtype)
    loaded = load_ours(dtype, device)
    tokenizer = loaded.tokenizer
    rng = random.Random(args.seed)
    turn1 = history(tokenizer, rng, args.history_tokens)
    turn1_prompt = tokenizer.encode_chat(turn1)
    ttft(fresh_engine(loaded), "warm-up", turn1_prompt[:64])

    engine = fresh_engine(loaded)
    replies = engine.generate([Request("turn-1", tuple(turn1_prompt), SamplingOptions(max_tokens=args.reply_tokens))])
    reply_text = "".join(output.text for output in replies["turn-1"])
    num_reply_tokens = sum(len(output.new_token_ids) for output in replies["turn-1"])

    runs = []
    for i in range(args.repeats):
        new_message = exact_tokens(rng, tokenizer, args.new_tokens)
        turn2 = turn1 + [{"role": "assistant", "content": reply_text}, {"role": "user", "content": new_message}]
        prompt = tokenizer.encode_chat(turn2)
        cold_ms, _ = ttft(fresh_engine(loaded), f"cold-{i}", prompt)
        warm_ms, num_cached = ttft(engine, f"turn-2-{i}", prompt)
        runs.append(
            {"cold_ttft_ms": cold_ms, "warm_ttft_ms": warm_ms, "num_prompt_tokens": len(prompt), "num_cached_tokens": num_cached,
             "num_new_message_tokens": len(tokenizer.encode(new_message))}
        )  # fmt: skip

    cold_ms = statistics.median(run["cold_ttft_ms"] for run in runs)
    warm_ms = statistics.median(run["warm_ttft_ms"] for run in runs)
    result = {
        "cold_ttft_ms": cold_ms,
        "warm_ttft_ms": warm_ms,
        "warm_over_cold": warm_ms / cold_ms,
        "target": {"warm_over_cold": TARGET_WARM_OVER_COLD, "met": warm_ms / cold_ms <= TARGET_WARM_OVER_COLD},
        "num_history_tokens": len(turn1_prompt),
        "num_history_messages": len(turn1),
        "num_reply_tokens": num_reply_tokens,
        "num_prompt_tokens": runs[0]["num_prompt_tokens"],
        "num_cached_tokens": runs[0]["num_cached_tokens"],
        "runs": runs,
        "env": {
            "dtype": str(dtype).removeprefix("torch."),
            "device": device,
            "threads": num_threads,
            "torch": torch.__version__,
            "quick": args.quick,
        },
    }
    result["elapsed_s"] = time.perf_counter() - bench_start_s
    print_table(result)
    write_json(args.out, result)


def print_table(r: dict) -> None:
    runs = r["runs"]
    print(f"\nPrefix cache bench: SmolLM2-135M-Instruct, {r['env']['dtype']} on {r['env']['device']}, torch threads={r['env']['threads']}")
    print(f"turn 1: {r['num_history_tokens']}-token history ({r['num_history_messages']} messages), "
          f"reply of {r['num_reply_tokens']} tokens; turn 2 adds a {runs[0]['num_new_message_tokens']}-token message "
          f"-> {r['num_prompt_tokens']}-token prompt")  # fmt: skip
    print("-" * 78)
    print(f"  {'':<40}{'median':>10}   runs (ms)")
    for label, key in (("cold TTFT, fresh engine", "cold_ttft_ms"), ("turn-2 TTFT, engine that served turn 1", "warm_ttft_ms")):
        print(f"  {label:<40}{r[key]:>7.1f} ms   " + " ".join(f"{run[key]:.1f}" for run in runs))
    print(f"  {'prompt tokens served from the cache':<40}{r['num_cached_tokens']:>10}   of {r['num_prompt_tokens']}")
    print(f"  {'turn-2 / cold':<40}{100 * r['warm_over_cold']:>9.1f}%   target <= {100 * TARGET_WARM_OVER_COLD:.0f}%  "
          f"{mark(r['target']['met'])}")  # fmt: skip
    print("-" * 78)
    print(f"target is information, not pass/fail of this command; bench took {r['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
