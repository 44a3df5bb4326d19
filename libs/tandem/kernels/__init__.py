"""Attention kernels over the paged KV cache (see tandem.kernels.metadata for the layout): a torch
reference, C++ kernels for the CPU (with a batched torch path where they cannot be built), and a
triton kernel for GPUs."""

from __future__ import annotations

import torch

from tandem.kernels import cpu_extension
from tandem.kernels.attention_cpu import paged_attention_cpu
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.kernels.attention_torch import paged_attention_torch
from tandem.kernels.metadata import AttentionFn
from tandem.kernels.paged_attention_triton import is_triton_available, paged_attention_triton


def select_attention(device: torch.device | str) -> AttentionFn:
    """The fastest backend for `device`: the triton kernel on CUDA when triton is installed, the
    C++ kernels on the CPU when they build here (cpu_extension), the batched torch path otherwise."""
    kind = torch.device(device).type
    if kind == "cuda" and is_triton_available():
        return paged_attention_triton
    if kind == "cpu" and cpu_extension.load():
        return paged_attention_cpu
    return paged_attention_torch


__all__ = [
    "AttentionFn",
    "is_triton_available",
    "paged_attention_cpu",
    "paged_attention_reference",
    "paged_attention_torch",
    "paged_attention_triton",
    "select_attention",
]
