"""Model test fixtures: the real SmolLM2 checkpoint (loaded once per session) and a small driver
that runs a model over a paged KV cache step by step, the way the engine does."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tandem.kernels.attention_reference import paged_attention_reference
from tandem.kernels.metadata import AttentionMetadata, KvCacheShape
from tandem.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded GGUF in float32, so greedy picks do not depend on the CPU's bf16 support."""
    return load_model(None, torch.float32, "cpu", paged_attention_reference)


@dataclass
class PagedSequence:
    """A sequence the way the engine holds one: its tokens, its (deliberately scattered) blocks,
    and how many of its tokens the KV cache already holds."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed: int = 0


class PagedRunner:
    """Drives a model step by step over a paged KV cache, building each step's metadata as the
    engine does, so tests can chunk prefills and interleave sequences freely."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int) -> None:
        config = model.config
        shape = KvCacheShape(num_blocks, config.num_layers, block_size, config.num_kv_heads, config.head_dim)
        self.model = model
        self.block_size = block_size
        self.kv_cache = torch.zeros(shape.as_tuple(), dtype=model.model.embed_tokens.weight.dtype)

    def step(self, work: list[tuple[PagedSequence, int]]) -> list[torch.Tensor]:
        """One ragged forward over `work` = [(sequence, how many of its next tokens to compute)];
        returns each sequence's logits (num_new, vocab)."""
        input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for seq, num_new in work:
            first, end = seq.num_computed, seq.num_computed + num_new
            for pos in range(first, end):
                input_ids.append(seq.token_ids[pos])
                positions.append(pos)
                slots.append(seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            seq_lens.append(end)
            starts.append(starts[-1] + num_new)
            seq.num_computed = end
        max_blocks = max(len(seq.block_ids) for seq, _ in work)
        tables = [seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq, _ in work]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            max_query_len=max(n for _, n in work),
            max_seq_len=max(seq_lens),
            is_decode_only=all(n == 1 for _, n in work),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_cache, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([n for _, n in work]))


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    return PagedRunner


@pytest.fixture
def paged_sequence() -> type[PagedSequence]:
    return PagedSequence
