"""What a grammar costs per decode step: the token masks of structured output, batch 1 and 32.

    .venv/bin/python bench/structured_output.py [--tokenizer MODEL_PATH] [--steps 64] [--quick]
        [--threads N] [--out build/bench/structured_output.json]

For each grammar library that imports (llguidance through the engine's own mask code,
engine/grammar_mask.py; xgrammar with its own bitmask kernel, if installed), over SmolLM2's
tokenizer (49,152 tokens): the time to compile a small JSON schema into a matcher, and per step
the time to fill every row's bitmask, apply it to a float32 [rows, vocab] logits tensor and
advance each row's matcher by a random allowed token (each row walks its own way through the
schema; the picking itself is not timed): the median step and the best (on a shared host the
best is the steadier). The host's CPU flags head the table: the mask work runs on its cores.
The target: llguidance's whole mask step at batch 32 within TARGET_STEP_MS (a small part of a
CPU decode step of that batch).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tandem.models.loader import load_tokenizer

TARGET_STEP_MS = 5.0
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
    },
    "required": ["name", "age", "tags", "city"],
    "additionalProperties": False,
}


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " ".join(sorted(set(re.findall(r"amx_[a-z0-9]*|avx512_bf16|avx512f|avx2", text))))


def _random_allowed(bits: torch.Tensor, vocab_size: int, generator: torch.Generator) -> int:
    allowed = ((bits.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab_size].nonzero().flatten()
    return int(allowed[torch.randint(len(allowed), (1,), generator=generator)])


def bench_llguidance(tokenizer_json: str, vocab_size: int, eos: list[int], batch: int, steps: int) -> dict[str, Any]:
    import llguidance

    from tandem.engine.grammar_mask import allowed_tokens

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    start = time.perf_counter()
    llguidance.LLMatcher(tokenizer, grammar)
    compile_ms = (time.perf_counter() - start) * 1000
    step_ms: list[float] = []
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # fresh matchers when a round's rows finish, until `steps` steps are timed
        matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(batch)]
        while len(step_ms) < steps and not any(m.is_stopped() for m in matchers):
            logits = torch.randn(batch, vocab_size)
            start = time.perf_counter()
            allowed = allowed_tokens(matchers, vocab_size)  # what the engine's sampler does
            logits.masked_fill_(~allowed, float("-inf"))
            elapsed = time.perf_counter() - start
            tokens = [int(row.nonzero()[torch.randint(int(row.sum()), (1,), generator=generator)]) for row in allowed]
            start = time.perf_counter()
            for m, t in zip(matchers, tokens, strict=True):
                assert m.consume_token(t), m.get_error()
            step_ms.append((elapsed + time.perf_counter() - start) * 1000)
    return {
        "library": "llguidance",
        "batch": batch,
        "compile_ms": compile_ms,
        "step_ms": statistics.median(step_ms),
        "best_step_ms": min(step_ms),
    }


def bench_xgrammar(tokenizer_json: str, vocab_size: int, batch: int, steps: int) -> dict[str, Any] | None:
    try:
        import transformers
        import xgrammar
    except ImportError:
        return None
    from tokenizers import Tokenizer

    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_ms = (time.perf_counter() - start) * 1000
    step_ms: list[float] = []
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
        bitmask = xgrammar.allocate_token_bitmask(batch, vocab_size)
        while len(step_ms) < steps and not any(m.is_terminated() for m in matchers):
            logits = torch.randn(batch, vocab_size)
            start = time.perf_counter()
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            elapsed = time.perf_counter() - start
            tokens = [_random_allowed(bitmask[i], vocab_size, generator) for i in range(batch)]
            start = time.perf_counter()
            for m, t in zip(matchers, tokens, strict=True):
                assert m.accept_token(t)
            step_ms.append((elapsed + time.perf_counter() - start) * 1000)
    return {
        "library": "xgrammar",
        "batch": batch,
        "compile_ms": compile_ms,
        "step_ms": statistics.median(step_ms),
        "best_step_ms": min(step_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a model file or folder (default: the embedded SmolLM2)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="8 steps: a smoke run")
    parser.add_argument("--threads", type=int, help="torch threads")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = 8 if args.quick else args.steps
    tokenizer = load_tokenizer(args.tokenizer)
    tokenizer_json = tokenizer.backend.to_str()
    vocab_size = tokenizer.backend.get_vocab_size()
    rows: list[dict[str, Any]] = []
    for batch in (1, 32):
        rows.append(bench_llguidance(tokenizer_json, vocab_size, list(tokenizer.eos_token_ids), batch, steps))
        xg = bench_xgrammar(tokenizer_json, vocab_size, batch, steps)
        if xg is not None:
            rows.append(xg)
    print(f"CPU flags: {cpu_flags()}; torch threads {torch.get_num_threads()}; vocabulary {vocab_size}")
    print(f"{'library':<12} {'batch':>5} {'compile ms':>11} {'mask+apply ms/step':>19} {'best ms':>8}")
    for row in rows:
        print(f"{row['library']:<12} {row['batch']:>5} {row['compile_ms']:>11.1f} {row['step_ms']:>19.2f} {row['best_step_ms']:>8.2f}")
    step_ms = next(r["step_ms"] for r in rows if r["library"] == "llguidance" and r["batch"] == 32)
    verdict = "PASS" if step_ms <= TARGET_STEP_MS else "MISS"
    print(f"target: llguidance's mask step at batch 32 <= {TARGET_STEP_MS} ms: {step_ms:.2f} ms {verdict}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"cpu_flags": cpu_flags(), "vocab_size": vocab_size, "target_step_ms": TARGET_STEP_MS, "rows": rows}
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
