"""Next-token choice for a batch of sequences, each with its own options and random stream.

Greedy rows take the argmax. The others divide by their temperature, keep their top-k tokens,
their nucleus (the smallest set of most likely tokens whose probability reaches top_p, never
empty) and the tokens at least min_p times as likely as the likeliest (a token must pass all
three; the likeliest always does), and draw with the exponential race: argmax(p / E) with E ~ Exp(1) picks token i
with probability p_i. The race needs only elementwise noise, so each row draws its noise from
its token's own seeded generator (same seed and position, same token) while the arithmetic stays batched
and nothing waits on the host until the caller reads the result. Before any of it, each row's
logits are processed as its request asks (engine/logits_processors.py), greedy rows included.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from tandem.engine.logits_processors import process_logits
from tandem.engine.sequence import SamplingOptions, Sequence
from tandem.kernels import cpu_extension

_MASK_64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)


def token_generator(seed: int, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The random stream of the token a seeded sequence samples at `position` (its token count
    then): a function of (seed, position) only, so any worker draws the same token there, and
    nearby seeds or positions give unrelated streams."""
    return torch.Generator(device=device).manual_seed(_splitmix64(_splitmix64(seed & _MASK_64) ^ position))


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        seqs: SequenceOf[Sequence],
        generators: SequenceOf[torch.Generator | None],
    ) -> torch.Tensor:
        """One token id per row of `logits` (N, vocab), row i for seqs[i] (its options, and the
        tokens so far, which some options read); a LongTensor (N,) on logits' device."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs) or len(seqs) != len(generators):
            raise ValueError(
                f"logits {tuple(logits.shape)} need one sequence and one generator per row, got {len(seqs)} and {len(generators)}"
            )
        options = [seq.sampling for seq in seqs]
        logits = process_logits(logits, seqs)
        tokens = _argmax(logits)
        random_rows = [i for i, option in enumerate(options) if not option.is_greedy]
        if not random_rows:
            return tokens
        row_options = [options[i] for i in random_rows]
        rows = torch.tensor(random_rows, device=logits.device)
        temperatures = torch.tensor([o.temperature for o in row_options], dtype=torch.float32, device=logits.device)
        scaled = logits[rows].float() / temperatures.unsqueeze(1)
        probs, token_of_column = _filtered_probs(scaled, row_options)
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(random_rows):
            if generators[i] is not None:
                noise[j].exponential_(generator=generators[i])
        choice = _argmax(probs / noise.clamp_(min=torch.finfo(torch.float32).tiny))
        if token_of_column is not None:
            choice = token_of_column.gather(1, choice.unsqueeze(1)).squeeze(1)
        tokens[rows] = choice
        return tokens


def _argmax(rows: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, as torch.argmax answers it (the first of equals, a NaN first): on a CPU
    by the C++ kernels', much faster than torch's on a batch's logits over a whole vocabulary."""
    if rows.device.type == "cpu" and cpu_extension.load():
        tokens: torch.Tensor = torch.ops.tandem.argmax_rows(rows)
        return tokens
    return rows.argmax(dim=-1)


def _filtered_probs(scaled: torch.Tensor, options: list[SamplingOptions]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities after top-k, top-p and min-p (unnormalised), and, when sorted, each column's token."""
    if all(o.top_k == 0 and o.top_p >= 1.0 and o.min_p == 0.0 for o in options):
        return torch.softmax(scaled, dim=-1), None
    vocab_size = scaled.shape[1]
    device = scaled.device
    sorted_logits, token_of_column = scaled.sort(dim=-1, descending=True)
    top_k = torch.tensor([o.top_k if 0 < o.top_k < vocab_size else vocab_size for o in options], device=device)
    ranks = torch.arange(vocab_size, device=device)
    sorted_logits = sorted_logits.masked_fill(ranks.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # A token is in the nucleus while the mass ranked above it is still short of top_p; the first
    # always is. Rows with top_p = 1 get a threshold no sum reaches, so rounding drops nothing.
    top_p = torch.tensor([o.top_p if o.top_p < 1.0 else 2.0 for o in options], dtype=torch.float32, device=device)
    mass_above = probs.cumsum(dim=-1) - probs
    below_min_p = probs < probs[:, :1] * torch.tensor([o.min_p for o in options], dtype=torch.float32, device=device).unsqueeze(1)
    probs = probs.masked_fill((mass_above >= top_p.unsqueeze(1)) | below_min_p, 0.0)
    return probs, token_of_column
