"""The log-probabilities a request asks for: the sampled token's, and the k likeliest tokens'.

They are the model's own: log_softmax of the row's raw logits in float32, before the request's
logits processors (logit_bias, penalties, min_tokens) and before temperature, top-k, top-p and
min-p, as vLLM's server returns them by default. So a sampled token's logprob says how likely
the model found it, whatever the sampling settings did to the choice.

Only the rows that ask are computed (one log_softmax and one torch.topk over them, batched, k
the largest any of them asks); a batch where no row asks costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from tandem.engine.sequence import Sequence


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # the sampled token's
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the likeliest tokens, likeliest first


def token_logprobs(logits: torch.Tensor, seqs: SequenceOf[Sequence], token_ids: torch.Tensor) -> dict[int, TokenLogprobs]:
    """{row: its logprobs} for each row of `logits` (N, vocab) whose seqs[row] asks, token_ids[row]
    being the token sampled there; {} (and no work) when none asks."""
    rows = [row for row, seq in enumerate(seqs) if seq.sampling.top_logprobs is not None]
    if not rows:
        return {}
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    sampled = logprobs.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1)
    num_top = max(seqs[row].sampling.top_logprobs or 0 for row in rows)
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # sorted, likeliest first
    sampled_list, value_lists, id_lists = sampled.tolist(), top_values.tolist(), top_ids.tolist()
    answers: dict[int, TokenLogprobs] = {}
    for j, row in enumerate(rows):
        k = seqs[row].sampling.top_logprobs or 0
        answers[row] = TokenLogprobs(sampled_list[j], tuple(zip(id_lists[j][:k], value_lists[j][:k])))
    return answers
