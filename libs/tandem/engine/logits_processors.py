"""What a request's own parameters do to its row of logits before a token is chosen.

`min_tokens` masks the sequence's end-of-sequence tokens and its stop_token_ids until that many
tokens are out. Each rule is applied to the whole batch at once: the per-sequence Python work is
building the index tensors, once per step; a batch where no row asks for a rule costs nothing,
and the logits come back untouched.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from tandem.engine.sequence import Sequence


def process_logits(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
    """Row i of `logits` (N, vocab) as seqs[i]'s parameters ask; `logits` itself when none ask."""
    return _mask_early_ends(logits, seqs)


def _mask_early_ends(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
    """-inf at the tokens that would end a sequence that has not yet reached its min_tokens."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    columns: list[int] = []
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens >= seq.sampling.min_tokens:
            continue
        # eos_token_ids is empty for a sequence that ignores eos; a stop token id may lie
        # outside the vocabulary (the chat checks only its range), and then nothing samples it.
        ending = [t for t in seq.eos_token_ids.union(seq.sampling.stop_token_ids) if t < vocab_size]
        rows.extend([row] * len(ending))
        columns.extend(ending)
    if not rows:
        return logits
    masked = logits.clone()
    index = torch.tensor([rows, columns], dtype=torch.int64, device=logits.device)
    masked[index[0], index[1]] = float("-inf")
    return masked
