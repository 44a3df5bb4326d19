"""Executes a StepPlan: one batched forward over the ragged batch (prefill chunks and decode
tokens together, no padding), then sampling for every sequence whose context is now complete.

Replayed tokens: a prefill chunk may hold tokens the model generated earlier (a continuation of a
reply whose worker died, a preempted sequence's recompute). Those are computed the way they were
first computed, as decodes: each is a one-row piece of the step's forward with its own context
length, so attention takes it on the decode path, as the step that generated it did, and its K
and V (written before any attention reads them) are those of that step. A prompt token goes
the prefill path. Rows keep their bits in any company (the projections' row limit, the prefill
attention's absolute blocks), so a continuation is bit for bit its uninterrupted run, in one
forward. The scheduler puts at most max_replayed_tokens_per_step generated tokens of a sequence
in a step.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from tandem.engine.decode_graphs import DecodeGraphs
from tandem.engine.logprobs import TokenLogprobs, token_logprobs
from tandem.engine.sampling import Sampler, token_generator
from tandem.engine.scheduler import StepPlan
from tandem.engine.sequence import Sequence
from tandem.kernels.metadata import AttentionMetadata
from tandem.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class RankStep:
    """What rank 0 broadcasts to the other ranks of a tensor-parallel engine for each forward: its
    inputs, and whether logits follow (every rank computes its columns, gathered on all)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    wants_logits: bool


@dataclass(frozen=True)
class Sampled:
    """A step's sampled tokens, and the logprobs of those whose requests ask for them."""

    token_ids: dict[str, int]  # seq_id -> token, for the plan's sampled sequences
    logprobs: dict[str, TokenLogprobs]  # seq_id -> its token's logprobs (engine/logprobs.py)


NOTHING_SAMPLED = Sampled({}, {})


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # row of the hidden states whose logits are sampled, one per sampling sequence
    sampling_seqs: list[Sequence]


@dataclass(frozen=True)
class Rows:
    """Tokens start..end-1 of `seq`, computed in one forward; `is_sampled`: its last row is sampled."""

    seq: Sequence
    start: int
    end: int
    is_sampled: bool

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.end]


def forward_passes(plan: StepPlan) -> list[list[Rows]]:
    """The step's forward (one, or none for an empty plan): every row a chunk computes as given
    (decodes, prompt tokens), then each generated token a prefill chunk recomputes as a one-row
    piece of its own (see the module docstring)."""
    rows: list[Rows] = []
    replayed: list[Rows] = []
    for chunk in plan.scheduled:
        seq, start, end = chunk.seq, chunk.num_computed_tokens, chunk.num_context_tokens
        replay_from = end if end - start == 1 else min(end, max(start, seq.num_prompt_tokens))
        if replay_from > start:
            rows.append(Rows(seq, start, replay_from, chunk.is_sampled and replay_from == end))
        replayed.extend(Rows(seq, position, position + 1, chunk.is_sampled and position + 1 == end) for position in range(replay_from, end))
    return [rows + replayed] if rows or replayed else []


def build_inputs(rows: SequenceOf[Rows], block_size: int, device: torch.device) -> StepInputs:
    """Lays the rows end to end and describes them for attention."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    sampling_seqs: list[Sequence] = []
    for piece in rows:
        seq, start, end = piece.seq, piece.start, piece.end
        input_ids.extend(piece.token_ids)
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start_loc.append(len(input_ids))
        seq_lens.append(end)
        tables.append(table)
        if piece.is_sampled:  # the whole known sequence is computed: sample its next token
            sample_rows.append(len(input_ids) - 1)
            sampling_seqs.append(seq)
    max_blocks = max(len(t) for t in tables)
    block_tables = [t + [0] * (max_blocks - len(t)) for t in tables]
    q_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]

    def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64),
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(block_tables, torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        is_decode_only=max(q_lens) == 1,
    )
    return StepInputs(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        meta=meta,
        sample_rows=tensor(sample_rows, torch.int64),
        sampling_seqs=sampling_seqs,
    )


class Runner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int, sampler: Sampler, graphs: DecodeGraphs | None = None
    ) -> None:
        """`graphs`: decode-only steps it serves run through it (CUDA graphs, engine/decode_graphs.py)."""
        self._model = model
        self._kv_cache = kv_cache
        self._block_size = block_size
        self._sampler = sampler
        self._graphs = graphs

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv_cache

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self._graphs

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> Sampled:
        """Runs the plan's forward and returns the sampled token of each sequence that samples."""
        if not plan.scheduled:
            return NOTHING_SAMPLED
        passes = forward_passes(plan)
        if self._graphs is not None and len(passes) == 1 and self._is_graph_step(passes[0]):
            rows = passes[0]
            logits = self._graphs.run([r.seq.token_ids[r.start] for r in rows], [r.start for r in rows], [r.seq.block_table for r in rows])
            return self._sample(logits, [r.seq for r in rows])
        parts: list[torch.Tensor] = []
        sampling_seqs: list[Sequence] = []
        tp = self._model.tp
        for rows in passes:
            inputs = build_inputs(rows, self._block_size, self._kv_cache.device)
            if tp.size > 1:  # forward_passes gives one pass: the peers compute its logits with rank 0
                step = RankStep(inputs.input_ids, inputs.positions, inputs.meta, inputs.sample_rows, bool(inputs.sampling_seqs))
                tp.broadcast(step)
            hidden = self._model(inputs.input_ids, inputs.positions, self._kv_cache, inputs.meta)
            parts.append(hidden[inputs.sample_rows])
            sampling_seqs.extend(inputs.sampling_seqs)
        if not sampling_seqs:
            return NOTHING_SAMPLED
        sampled = parts[0]
        if len(parts) > 1:  # replayed tokens: back to the plan's order, as one forward leaves them
            row_of = {seq.seq_id: row for row, seq in enumerate(sampling_seqs)}
            sampling_seqs = plan.sampled_seqs
            order = torch.tensor([row_of[seq.seq_id] for seq in sampling_seqs], device=sampled.device)
            sampled = torch.cat(parts).index_select(0, order)
        return self._sample(self._model.compute_logits(sampled), sampling_seqs)

    @torch.inference_mode()
    def compute(self, step: RankStep) -> None:
        """On a tensor-parallel engine's other ranks: one forward rank 0 broadcast (this rank's heads'
        share, the all-reduces with the other ranks), and its logits' columns where it samples."""
        hidden = self._model(step.input_ids, step.positions, self._kv_cache, step.meta)
        if step.wants_logits:
            self._model.compute_logits(hidden[step.sample_rows])

    def stop_peers(self) -> None:
        """On rank 0: the other ranks' `follow` returns (their processes then end)."""
        if self._model.tp.size > 1:
            self._model.tp.broadcast(None)

    def _is_graph_step(self, rows: list[Rows]) -> bool:
        """Every row one sampled token (decodes, a prompt's last token) and the graphs take the batch."""
        assert self._graphs is not None
        if not all(r.end - r.start == 1 and r.is_sampled for r in rows):
            return False
        return self._graphs.serves(len(rows), max(len(r.seq.block_table) for r in rows))

    def _sample(self, logits: torch.Tensor, sampling_seqs: list[Sequence]) -> Sampled:
        generators = [self._generator(seq) for seq in sampling_seqs]
        tokens = self._sampler.sample(logits, sampling_seqs, generators)
        logprobs = token_logprobs(logits, sampling_seqs, tokens)  # the raw logits: the model's own
        token_list = tokens.tolist()
        return Sampled(
            {seq.seq_id: token for seq, token in zip(sampling_seqs, token_list)},
            {sampling_seqs[row].seq_id: answer for row, answer in logprobs.items()},
        )

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """A seeded sequence's random stream for the token it samples now, derived from its seed and
        that token's position alone: a continuation on another worker (prefill handoff, a worker
        that died) draws the very tokens this one would have."""
        if seq.sampling.seed is None or seq.sampling.temperature == 0:
            return None
        return token_generator(seq.sampling.seed, seq.num_tokens, self._kv_cache.device)
