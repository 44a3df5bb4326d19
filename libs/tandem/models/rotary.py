"""Rotary position embeddings: a cos/sin table for every position of the window, indexed by the
positions of this step's tokens, applied in the Hugging Face "rotate_half" convention (dimension
i pairs with i + head_dim/2). GGUF checkpoints use the same convention once gguf_weights.py has
undone llama.cpp's Q/K row permutation.

Phi-3's "longrope" gives each position its own frequencies, as vLLM does: positions inside the
original training window use `short_factor`'s divisors, positions past it `long_factor`'s, so the
table still has one row per position and the forward is the same for every scaling.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from tandem.models.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig, *, is_long: bool = False) -> torch.Tensor:
    """(head_dim/2,) float64 angular frequency of each rotated pair, scaling applied. `is_long`:
    longrope's frequencies for positions past the original window (else those inside it)."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        divisors = scaling.long_factor if is_long else scaling.short_factor
        if len(divisors) != len(inv_freq):
            raise ValueError(f"longrope needs {len(inv_freq)} factors (head_dim/2), the config gives {len(divisors)}")
        inv_freq = inv_freq / torch.tensor(divisors, dtype=torch.float64)
    elif scaling is not None:
        inv_freq = _scaled(inv_freq, scaling)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    return inv_freq


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: longrope's attention factor, 1.0 for every other scaling."""
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type != "longrope":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))


def _scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: the same formula as Hugging Face's _compute_llama3_parameters
    old_window = scaling.original_max_position_embeddings
    low_freq_wavelen = old_window / scaling.low_freq_factor
    high_freq_wavelen = old_window / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_window / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos_sin: torch.Tensor  # a buffer: (window, head_dim) cos then sin, float32

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # float32 whatever the model's dtype: bf16 cos/sin lose the angle at long positions.
        # Not persistent: it is derived from the config, never loaded from a checkpoint.
        self.register_buffer("cos_sin", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:
        # On the CPU even inside `torch.device("meta")` (LlamaForCausalLM.empty): meta tensors
        # would carry no values, and their first ops import torch's decompositions (seconds).
        with torch.device("cpu"):
            positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float64)
            angles = torch.outer(positions, inverse_frequencies(self.config))
            scaling = self.config.rope_scaling
            if scaling is not None and scaling.rope_type == "longrope":
                is_long = positions >= scaling.original_max_position_embeddings
                long_angles = torch.outer(positions, inverse_frequencies(self.config, is_long=True))
                angles = torch.where(is_long.unsqueeze(1), long_angles, angles)
            table = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor(self.config)
            return table.float()  # (window, head_dim)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        # The table is derived, so every move or cast (`.to(bf16)`, `to_empty` after building on
        # the meta device) rebuilds it in float32 on the new device instead of converting it.
        super()._apply(fn, recurse)
        self.cos_sin = self._table().to(self.cos_sin.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, head_dim/2) float32 for positions (T,); computed once per step, shared by
        every layer."""
        cos, sin = self.cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim) rotated in float32, returned in x's dtype."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.to(x.dtype)
