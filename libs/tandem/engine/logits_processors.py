"""What a request's own parameters do to its row of logits before a token is chosen.

In this order, as vLLM applies them: `logit_bias` adds to the named tokens' logits; vLLM's (and
Hugging Face's) `repetition_penalty` p divides the positive logits of every token the prompt or
the output so far has by p and multiplies the negative ones by p; OpenAI's `frequency_penalty`
and `presence_penalty` subtract `frequency * count + presence * (count > 0)`, count being how
often the output so far has the token; `min_tokens` masks the sequence's end-of-sequence tokens
and stop_token_ids until that many tokens are out; last, a sequence with a grammar (structured
output) keeps only the tokens its grammar allows next (engine/grammar_mask.py), whatever the
rules before made likeliest.

The penalties read the whole sequence (prompt, then every output token), which a continuation on
another worker has too, so a continued reply is penalised as an uninterrupted one. Each rule is
applied to the whole batch at once, by gathers and scatters at the (row, token) places the
sequences name (no host sync, no batch x vocabulary temporaries); the per-sequence Python work
is building the index tensors, once per step (a prompt's distinct tokens once per sequence: a
prompt never changes), and a batch where no row asks for a rule costs nothing: the logits come
back untouched.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence as SequenceOf

import torch

from tandem.engine.grammar_mask import allowed_tokens
from tandem.engine.sequence import Sequence


def process_logits(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
    """Row i of `logits` (N, vocab) as seqs[i]'s parameters ask; `logits` itself when none ask."""
    logits = _add_logit_bias(logits, seqs)
    logits = _apply_penalties(logits, seqs)
    logits = _mask_early_ends(logits, seqs)
    return _mask_grammars(logits, seqs)


def _add_logit_bias(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
    vocab_size = logits.shape[1]
    rows: list[int] = []
    columns: list[int] = []
    biases: list[float] = []
    for row, seq in enumerate(seqs):
        for token_id, bias in seq.sampling.logit_bias:
            if token_id < vocab_size:  # a token the model lacks is never sampled: nothing to bias
                rows.append(row)
                columns.append(token_id)
                biases.append(bias)
    if not rows:
        return logits
    biased = logits.to(torch.float32, copy=True)
    index = torch.tensor([rows, columns], dtype=torch.int64, device=logits.device)
    biased.index_put_((index[0], index[1]), torch.tensor(biases, dtype=torch.float32, device=logits.device), accumulate=True)
    return biased


def _apply_penalties(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
    """Only the (row, token) places the sequences' tokens name are read and written, so the cost
    follows the number of tokens, not batch x vocabulary. A token that comes several times is
    written several times with the same value (read before any write), which any order of the
    writes leaves right; only the frequency penalty accumulates, once per occurrence."""
    penalised_rows = [row for row, seq in enumerate(seqs) if seq.sampling.has_penalties]
    if not penalised_rows:
        return logits
    device = logits.device
    vocab_size = logits.shape[1]
    penalised = [seqs[row] for row in penalised_rows]
    options = [seq.sampling for seq in penalised]
    rows = torch.tensor(penalised_rows, dtype=torch.int64, device=device)
    selected = logits[rows].float()  # a copy: the caller's logits stay as they were
    flat = selected.view(-1)
    if any(o.repetition_penalty != 1.0 for o in options):
        seen_rows, seen_ids = _flat([torch.cat((_prompt_ids(seq, device), _output_ids(seq, device))) for seq in penalised])
        at = seen_rows * vocab_size + seen_ids
        values = flat[at]
        scale = _values([o.repetition_penalty for o in options], device)[seen_rows]
        flat[at] = torch.where(values > 0, values / scale, values * scale)
    output_rows, output_ids = _flat([_output_ids(seq, device) for seq in penalised])
    at = output_rows * vocab_size + output_ids
    flat[at] = flat[at] - _values([o.presence_penalty for o in options], device)[output_rows]
    flat.index_add_(0, at, -_values([o.frequency_penalty for o in options], device)[output_rows])
    adjusted = logits.to(torch.float32, copy=True)
    adjusted[rows] = selected
    return adjusted


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


def _mask_grammars(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
    """-inf at every token a row's grammar does not allow next; rows without one are untouched."""
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return logits
    allowed = allowed_tokens([seqs[row].grammar for row in rows], logits.shape[1])  # type: ignore[misc]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    masked = logits.clone()
    masked[index] = masked[index].masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))
    return masked


# A sequence's prompt's distinct token ids, on the device, made at its first penalised step.
_PROMPT_IDS: weakref.WeakKeyDictionary[Sequence, torch.Tensor] = weakref.WeakKeyDictionary()


def _prompt_ids(seq: Sequence, device: torch.device) -> torch.Tensor:
    ids = _PROMPT_IDS.get(seq)
    if ids is None or ids.device != device:
        prompt = torch.tensor(seq.token_ids[: seq.num_prompt_tokens], dtype=torch.int64)
        ids = _PROMPT_IDS[seq] = torch.unique(prompt).to(device)
    return ids


def _output_ids(seq: Sequence, device: torch.device) -> torch.Tensor:
    return torch.tensor(seq.token_ids[seq.num_prompt_tokens :], dtype=torch.int64).to(device)


def _flat(ids_per_row: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each id, id) over all rows' ids, as two index tensors on the ids' device."""
    ids = torch.cat(ids_per_row)
    lengths = torch.tensor([len(row) for row in ids_per_row], dtype=torch.int64, device=ids.device)
    rows = torch.repeat_interleave(torch.arange(len(ids_per_row), device=ids.device), lengths)
    return rows, ids


def _values(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
