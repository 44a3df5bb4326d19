"""Every architecture's forward with the triton attention kernel, in triton's CPU interpreter,
against transformers: the sliding windows, soft-caps and head size 96 as the GPU path runs them.

Started by test_triton_architectures.py in a subprocess with TRITON_INTERPRET=1 (see
triton_interpreter.py). For each architecture it writes transformers' tiny checkpoint, loads it
with the triton kernel as the attention, prefills the prompt in two chunks over a paged cache and
decodes a few tokens, and prints one JSON line: the largest logit difference from transformers
and whether the greedy tokens are transformers'. Exit status 1 if any case disagrees.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from hf_models import ARCHITECTURES, hf_greedy, hf_logits, write_hf_checkpoint
from triton_interpret_check import work_around_triton_9171

from tandem.kernels import paged_attention_triton
from tandem.kernels.metadata import AttentionMetadata, KvCacheShape
from tandem.models.loader import load_model

PROMPT = [1, 17, 300, 42, 42, 9, 250, 77, 5, 130, 64, 200, 33, 3]
NEW_TOKENS = 4
LOGITS_ATOL = 2e-4  # float32: rounding only (test_architectures.py's tolerance)
BLOCK_SIZE = 4


def run(model: torch.nn.Module, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of each new token over a paged cache, the prompt in `chunks`, one step per chunk."""
    config = model.config
    shape = KvCacheShape(16, config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    kv_cache = torch.zeros(shape.as_tuple())
    blocks = [9, 2, 14, 5, 11, 0, 7, 3]
    out, done = [], 0
    for n in chunks:
        positions = list(range(done, done + n))
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([done + n], dtype=torch.int32),
            block_tables=torch.tensor([blocks], dtype=torch.int32),
            max_query_len=n,
            max_seq_len=done + n,
            is_decode_only=n == 1,
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(token_ids[done : done + n]), torch.tensor(positions), kv_cache, meta)
            out.append(model.compute_logits(hidden))
        done += n
    return torch.cat(out)


def main() -> int:
    work_around_triton_9171()
    failed = False
    for architecture in ARCHITECTURES:
        with tempfile.TemporaryDirectory() as folder:
            reference = write_hf_checkpoint(architecture, Path(folder), seed=3)
            loaded = load_model(Path(folder), torch.float32, "cpu", paged_attention_triton, pack=False)
        expected_tokens = hf_greedy(reference, PROMPT, NEW_TOKENS)
        ids = PROMPT + expected_tokens[:-1]
        logits = run(loaded.model, ids, [8, len(PROMPT) - 8] + [1] * (NEW_TOKENS - 1))
        error = (logits[: len(PROMPT)] - hf_logits(reference, PROMPT)).abs().max().item()
        tokens = [int(row.argmax()) for row in logits[len(PROMPT) - 1 :]]
        ok = error <= LOGITS_ATOL and tokens == expected_tokens
        failed |= not ok
        print(json.dumps({"case": architecture, "ok": ok, "max_logit_error": error, "tokens_equal": tokens == expected_tokens}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
