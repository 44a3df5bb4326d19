"""Helpers the engine benches share: the model, seeded chat prompts, a timed engine run, output.

Run as scripts (`python bench/engine.py`), the benches import this module from their own folder.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.engine.engine import Engine, Request
from tandem.kernels import select_attention
from tandem.models.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from tandem.models.tokenizer import Tokenizer


def resolve_engine(device: str, dtype: str) -> tuple[str, torch.dtype]:
    """--device and --dtype as a worker resolves TANDEM_DEVICE and TANDEM_DTYPE ("auto": the GPU
    when torch sees one; bf16 where the device computes it natively)."""
    resolved = resolve_device(device, setting="--device")
    return resolved, resolve_dtype(dtype, resolved)


def load_ours(dtype: torch.dtype, device: str) -> LoadedModel:
    """The embedded SmolLM2-135M GGUF, as a worker's engine serves it on `device`."""
    return load_model(None, dtype, device, select_attention(device))


def set_threads(num_threads: int | None) -> int:
    if num_threads:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


# -- seeded chat text ---------------------------------------------------------------------------

TOPICS = (
    "the history of the printing press",
    "how vaccines train the immune system",
    "sourdough baking at high altitude",
    "the causes of the 2008 financial crisis",
    "how a bicycle stays upright",
    "photosynthesis in desert plants",
    "learning a second language as an adult",
    "how GPS satellites keep time",
    "composting in a small apartment",
    "the rules of cricket",
    "why the sky is blue",
    "writing a good cover letter",
    "how jet engines work",
    "caring for a young cat",
    "the water cycle",
    "saving for retirement",
    "the plot of Hamlet",
    "how noise-cancelling headphones work",
    "training for a first marathon",
    "the basics of music theory",
)
OPENERS = (
    "Can you explain {topic}?",
    "I'm preparing a short talk on {topic} and need help.",
    "My friend {name} and I disagree about {topic}.",
    "Please give me an overview of {topic}.",
    "What should a beginner know about {topic}?",
    "I keep reading conflicting things about {topic}.",
)
DETAILS = (
    "I live in {city}, if that matters.",
    "{name} says it takes about {number} years to really understand it.",
    "Last week I read an article claiming that {number} percent of people get this wrong.",
    "Please keep the answer {style}.",
    "I already know a little, so you can skip the very basics.",
    "My teacher mentioned {topic} in passing and I got curious.",
    "Could you add one concrete example?",
    "I tried to look it up in {city} library but the books were out of date.",
    "Assume I have about {number} minutes to read your answer.",
    "What is the most common misconception here?",
    "How would you explain it to a {number}-year-old?",
    "{name} thinks it is related to {topic}; is that right?",
    "If there are numbers involved, please show the arithmetic step by step.",
    "I would also like to know where to learn more afterwards.",
)
NAMES = ("Ana", "Bilal", "Chen", "Dmitri", "Efua", "Farah", "Goran", "Hana", "Ivo", "Jonas", "Kemi", "Lior")
CITIES = ("Lisbon", "Nairobi", "Osaka", "Toronto", "Lyon", "Quito", "Pune", "Tallinn", "Perth", "Cork")
STYLES = ("short", "friendly", "formal", "under a page", "in plain words", "with bullet points")


def _fill(template: str, rng: random.Random) -> str:
    return template.format(
        topic=rng.choice(TOPICS), name=rng.choice(NAMES), city=rng.choice(CITIES),
        number=rng.randint(2, 95), style=rng.choice(STYLES),
    )  # fmt: skip


def message_text(rng: random.Random, tokenizer: Tokenizer, num_tokens: int) -> str:
    """Seeded varied prose of about `num_tokens` tokens (never more, at least one sentence)."""
    text = _fill(rng.choice(OPENERS), rng)
    while True:
        longer = f"{text} {_fill(rng.choice(DETAILS), rng)}"
        if len(tokenizer.encode(longer)) > num_tokens:
            return text
        text = longer


def chat_prompts(tokenizer: Tokenizer, num_prompts: int, min_tokens: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Chat-templated single-question prompts whose lengths spread uniformly over [min, max] tokens."""
    rng = random.Random(seed)
    template_tokens = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))
    prompts = []
    for _ in range(num_prompts):
        target = rng.randint(min_tokens, max_tokens)
        text = message_text(rng, tokenizer, max(1, target - template_tokens))
        prompts.append(tokenizer.encode_chat([{"role": "user", "content": text}]))
    return prompts


# -- a timed engine run -------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestTiming:
    submit_s: float
    first_token_s: float
    last_token_s: float
    num_output_tokens: int
    num_cached_tokens: int
    output_token_ids: tuple[int, ...]

    @property
    def ttft_ms(self) -> float:
        return 1e3 * (self.first_token_s - self.submit_s)

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first: (last - first) / (n - 1)."""
        return 1e3 * (self.last_token_s - self.first_token_s) / max(1, self.num_output_tokens - 1)


def run_timed(engine: Engine, requests: Iterable[Request]) -> dict[str, RequestTiming]:
    """Submits every request at once, steps until all finish, and times each one's tokens."""
    submit_s: dict[str, float] = {}
    for request in requests:
        submit_s[request.request_id] = time.perf_counter()
        engine.add(request)
    first_s: dict[str, float] = {}
    tokens: dict[str, list[int]] = {request_id: [] for request_id in submit_s}
    timings: dict[str, RequestTiming] = {}
    while engine.has_work():
        outputs = engine.step()
        now_s = time.perf_counter()
        for output in outputs:
            if output.new_token_ids:
                first_s.setdefault(output.request_id, now_s)
                tokens[output.request_id].extend(output.new_token_ids)
            if output.is_finished:
                request_id = output.request_id
                timings[request_id] = RequestTiming(
                    submit_s[request_id], first_s.get(request_id, now_s), now_s,
                    len(tokens[request_id]), output.num_cached_tokens, tuple(tokens[request_id]),
                )  # fmt: skip
    return timings


def kv_blocks_for(token_counts: Iterable[int], block_size: int, num_spare: int = 16) -> int:
    """KV blocks that hold every sequence at its full length at once, so nothing is preempted."""
    return sum(-(-count // block_size) for count in token_counts) + num_spare


# -- output -------------------------------------------------------------------------------------

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")  # the ones torch's CPU kernels choose by


def cpu_host() -> dict[str, Any]:
    """This host's CPU: its model name, how many CPUs, and which of CPU_FLAGS it has."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    first = text.split("\n\n", 1)[0]
    model = next((line.split(":", 1)[1].strip() for line in first.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in first.splitlines() if line.startswith("flags")), [])
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags], "cpus": os.cpu_count()}


def cpu_line(cpu: dict[str, Any]) -> str:
    """cpu_host() as the benches print it."""
    flags = " ".join(cpu["flags"]) or "(none of " + " ".join(CPU_FLAGS) + ")"
    return f"CPU: {cpu['model']} ({cpu['cpus']} CPUs), flags: {flags}"


def percentile(values: Iterable[float], q: float) -> float:
    return float(np.percentile(list(values), q))


def mark(is_met: bool) -> str:
    return "PASS" if is_met else "MISS"


def write_json(path: Path | None, data: Mapping[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
