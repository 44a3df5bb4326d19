"""The position-independent pieces of a Llama block: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 (bf16 sums of squares drift), scaled in the model's dtype as
        # Hugging Face does, so logits match theirs.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul (rows [gate; up])."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        # nn.Module, not nn.Linear: quant.quantize_model may swap in an Int8Linear
        self.gate_up_proj: nn.Module = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj: nn.Module = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
