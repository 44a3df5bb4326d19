"""What this machine could do at best: its measured peaks, and a model's cost in FLOPs and bytes.

A roofline is a lower bound on time: a workload needs at least its FLOPs at the peak matmul rate
and at least its unavoidable memory traffic at the copy bandwidth, whichever is longer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.models.loader import LoadedModel
from tandem.ops.measure import measure_copy_bandwidth, measure_matmul_flops, measure_peak_flops

__all__ = [
    "ModelCost",
    "Roofline",
    "batch_roofline",
    "decode_roofline_tokens_per_s",
    "measure_copy_bandwidth",  # measured in tandem.ops.measure, which `tandem plan` shares
    "measure_matmul_flops",
    "measure_peak_flops",
]


@dataclass(frozen=True)
class ModelCost:
    """A Llama-family model's work per token. Weights count once however they are shared."""

    num_non_embedding_params: int
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    kv_bytes_per_token: int  # K and V of one token, every layer
    weight_bytes: int  # read by every forward step: the non-embedding weights and the lm_head

    @classmethod
    def of(cls, loaded: LoadedModel) -> ModelCost:
        """Parameters count the int8 projections of a quantized model (buffers: models/quant.py) and
        packed bf16 ones (models/packed.py) as the weights they stand for; bytes are what the
        tensors hold (int8 weights and their scales included; the rotary table, derived, and the
        packed copy of tied logits, which a step reads instead of the embedding, not)."""
        config = loaded.config
        model = loaded.model
        weights = {p.data_ptr(): p for p in model.parameters()}
        weights |= {t.data_ptr(): t for name, t in model.named_buffers() if name.endswith(("weight_int8", "weight_packed"))}
        scales = {t.data_ptr(): t for name, t in model.named_buffers() if name.endswith(".scale")}
        num_params = sum(t.numel() for t in weights.values())
        embedding = model.model.embed_tokens.weight
        num_embedding = embedding.numel() * (1 if config.tie_word_embeddings else 2)
        num_non_embedding = num_params - num_embedding
        total_bytes = sum(t.numel() * t.element_size() for t in (*weights.values(), *scales.values()))
        # every step reads all but the embedding (a lookup), whose tied copy is the lm_head
        untied_embedding_bytes = 0 if config.tie_word_embeddings else embedding.numel() * embedding.element_size()
        return cls(
            num_non_embedding_params=num_non_embedding,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            kv_bytes_per_token=2 * config.num_layers * config.num_kv_heads * config.head_dim * embedding.element_size(),
            weight_bytes=total_bytes - untied_embedding_bytes,
        )

    @property
    def logits_flops(self) -> int:
        return 2 * self.hidden_size * self.vocab_size

    @property
    def flops_per_token(self) -> int:
        """One decoded token: every non-embedding weight once (2 FLOPs a multiply-add), plus its logits."""
        return 2 * self.num_non_embedding_params + self.logits_flops

    def prefill_flops(self, num_positions: int) -> int:
        """One prompt's prefill: every non-embedding weight once a position, causal attention, and
        the logits of the last position only (the engine samples nothing else)."""
        return 2 * self.num_non_embedding_params * num_positions + self.logits_flops + self.attention_flops(num_positions)

    def attention_flops(self, num_positions: int) -> int:
        """QK^T and PV over causal attention for positions 0..n-1 (position j sees j+1 keys)."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * num_positions * (num_positions + 1) // 2


@dataclass(frozen=True)
class Roofline:
    compute_s: float  # the workload's FLOPs at the peak matmul rate
    memory_s: float  # its unavoidable bytes at the copy bandwidth
    num_output_tokens: int

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.time_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def batch_roofline(cost: ModelCost, prompt_lens: Sequence[int], num_output_tokens: int, peak_flops: float, bandwidth: float) -> Roofline:
    """The fastest this machine could serve the batch, every request running at once.

    FLOPs: each request forwards its prompt and all but its last output token through every
    weight (2 x non-embedding params each), computes logits for each output token, and attends
    causally. Bytes: producing n tokens takes n dependent forward steps, each reading the weights
    once for the whole batch; each decode step reads its sequence's KV so far; every forwarded
    token's KV is written once.
    """
    flops = 0
    num_bytes = num_output_tokens * cost.weight_bytes
    for prompt_len in prompt_lens:
        num_forwarded = prompt_len + num_output_tokens - 1
        flops += 2 * cost.num_non_embedding_params * num_forwarded + cost.logits_flops * num_output_tokens
        flops += cost.attention_flops(num_forwarded)
        # decode positions prompt_len .. num_forwarded-1, position j reads j+1 tokens of KV
        num_kv_reads = sum(range(prompt_len + 1, num_forwarded + 1))
        num_bytes += cost.kv_bytes_per_token * (num_kv_reads + num_forwarded)
    return Roofline(flops / peak_flops, num_bytes / bandwidth, len(prompt_lens) * num_output_tokens)


def decode_roofline_tokens_per_s(cost: ModelCost, batch_size: int, peak_flops: float, bandwidth: float) -> float:
    """The issue's decode-only bound: min(peak / flops_per_token, batch x bandwidth / weight_bytes).
    It leaves out prefill FLOPs and KV traffic, so it overstates what a batch with prompts can do."""
    return min(peak_flops / cost.flops_per_token, batch_size * bandwidth / cost.weight_bytes)
