"""Attention kernels over the paged KV cache (see tandem.kernels.metadata for the layout): a torch
reference, an optimised torch path for CPU, and a triton kernel for GPUs."""

from __future__ import annotations

import torch

from tandem.kernels.attention_reference import paged_attention_reference
from tandem.kernels.attention_torch import paged_attention_torch
from tandem.kernels.metadata import AttentionFn
from tandem.kernels.paged_attention_triton import is_triton_available, paged_attention_triton


def select_attention(device: torch.device | str) -> AttentionFn:
    """The fastest backend for `device`: the triton kernel on CUDA when triton is installed,
    the batched torch path everywhere else."""
    if torch.device(device).type == "cuda" and is_triton_available():
        return paged_attention_triton
    return paged_attention_torch


__all__ = [
    "AttentionFn",
    "is_triton_available",
    "paged_attention_reference",
    "paged_attention_torch",
    "paged_attention_triton",
    "select_attention",
]
