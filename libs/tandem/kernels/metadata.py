"""What one step's forward sees: the KV cache layout and the ragged batch's attention metadata.

This is the contract between the engine (which builds it), the model (which passes it through)
and the attention kernels (which read it).

KV cache: one tensor per engine, block-major, so one block's K and V for every layer are one
contiguous region (one UCX transfer per block):

    kv_cache.shape == (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    kv_cache[b, l, 0] is block b's K for layer l, kv_cache[b, l, 1] its V.

A layer's attention works on the strided views `kv_cache[:, l, 0]` and `kv_cache[:, l, 1]`, each
(num_blocks, block_size, num_kv_heads, head_dim). Token t of a sequence lives in block
`block_table[t // block_size]` at offset `t % block_size`; its flat slot is
`block_id * block_size + offset`.

The batch is ragged: the step's new tokens of every sequence are laid end to end (no padding).
Sequence s contributes `query_start_loc[s+1] - query_start_loc[s]` tokens (a prefill chunk, or 1
for a decode); they are the last tokens of its context of `seq_lens[s]` tokens, so its new token j
sits at absolute position `seq_lens[s] - q_len[s] + j` and attends to positions 0..that position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.kv_blocks import BLOCK_SIZE as BLOCK_SIZE  # defined torch-free: the router needs it too


@dataclass(frozen=True)
class KvCacheShape:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def as_tuple(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class AttentionMetadata:
    """The ragged batch of one step. All tensors live on the model's device."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: flat KV slot where each new token's K and V are written
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: cumulative count of new tokens per sequence
    seq_lens: torch.Tensor  # (num_seqs,) int32: context length of each sequence including this step's tokens
    block_tables: torch.Tensor  # (num_seqs, max_blocks_per_seq) int32; entries past a sequence's blocks are 0
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool  # every sequence has exactly one new token this step

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionFn(Protocol):
    """What every attention backend (tandem.kernels) is; see tandem.kernels.attention_reference for
    the contract. window > 0: a token at position p attends to positions p - window + 1 .. p only
    (a sliding window); 0: its whole causal context. softcap > 0: every score (already times
    `scale`) becomes softcap * tanh(score / softcap) before the mask and softmax; 0: none."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...
