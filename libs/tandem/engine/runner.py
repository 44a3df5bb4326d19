"""Executes a StepPlan: one batched forward over the ragged batch (prefill chunks and decode
tokens together, no padding), then sampling for every sequence whose context is now complete."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.sampling import Sampler, token_generator
from tandem.engine.scheduler import StepPlan
from tandem.engine.sequence import Sequence
from tandem.kernels.metadata import AttentionMetadata
from tandem.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # row of the hidden states whose logits are sampled, one per sampling sequence
    sampling_seqs: list[Sequence]


def build_inputs(plan: StepPlan, block_size: int, device: torch.device) -> StepInputs:
    """Lays the plan's chunks end to end and describes them for attention."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    sampling_seqs: list[Sequence] = []
    for chunk in plan.scheduled:
        seq = chunk.seq
        start, end = chunk.num_computed_tokens, chunk.num_context_tokens
        input_ids.extend(chunk.new_token_ids)
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start_loc.append(len(input_ids))
        seq_lens.append(end)
        tables.append(table)
        if chunk.is_sampled:  # the whole known sequence is computed: sample its next token
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
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int, sampler: Sampler) -> None:
        self._model = model
        self._kv_cache = kv_cache
        self._block_size = block_size
        self._sampler = sampler

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv_cache

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Runs the plan's forward and returns the sampled token of each sequence that samples."""
        if not plan.scheduled:
            return {}
        inputs = build_inputs(plan, self._block_size, self._kv_cache.device)
        hidden = self._model(inputs.input_ids, inputs.positions, self._kv_cache, inputs.meta)
        if not inputs.sampling_seqs:
            return {}
        logits = self._model.compute_logits(hidden[inputs.sample_rows])
        options = [seq.sampling for seq in inputs.sampling_seqs]
        generators = [self._generator(seq) for seq in inputs.sampling_seqs]
        tokens = self._sampler.sample(logits, options, generators).tolist()
        return {seq.seq_id: token for seq, token in zip(inputs.sampling_seqs, tokens)}

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """A seeded sequence's random stream for the token it samples now, derived from its seed and
        that token's position alone: a continuation on another worker (prefill handoff, a worker
        that died) draws the very tokens this one would have."""
        if seq.sampling.seed is None or seq.sampling.temperature == 0:
            return None
        return token_generator(seq.sampling.seed, seq.num_tokens, self._kv_cache.device)
