"""The position-independent pieces of a Llama block: RMSNorm, the gated MLP, and the projection
call that keeps a row's bits its own."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_extension, fused_triton
from tandem.kernels.gemm_choice import CPU_ROWS_PER_MATMUL  # oneDNN's calls of a row's own bits (why: there)


def has_cpu_kernels(x: torch.Tensor) -> bool:
    """x is on the CPU and the C++ kernels (tandem.kernels.cpu_extension) serve here: the norm and
    the rotation then take one call each instead of about ten torch ops (a noticeable share of a
    batch-1 decode step before they were fused)."""
    return x.is_cpu and cpu_extension.load()


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x) for x (T, in): on CPU in calls of at least 2 (an nn.Linear's) and at most
    CPU_ROWS_PER_MATMUL rows, unless the layer's kernel gives each row its own bits in any call."""
    if getattr(linear, "gives_rows_their_own_bits", False):  # models/packed.py's, by its forward (see models/llama.py)
        return linear.forward(x)
    if not x.is_cpu:
        return linear(x)
    if x.shape[0] == 1 and isinstance(linear, nn.Linear):  # an Int8Linear's kernel gives one row its batched bits
        return linear(x.expand(2, -1))[:1]
    if x.shape[0] <= CPU_ROWS_PER_MATMUL:
        return linear(x)
    dense = _dense_weight(linear, x)
    if dense is None or torch.is_grad_enabled():  # autograd refuses out=
        return torch.cat([linear(rows) for rows in x.split(CPU_ROWS_PER_MATMUL)])
    weight, scale, bias = dense
    # Each call writes its rows in place: no concatenation copy, so a long prefill costs the same.
    out = x.new_empty(x.shape[0], weight.shape[0])
    weight_t = weight.t()
    for start in range(0, x.shape[0], CPU_ROWS_PER_MATMUL):
        rows = slice(start, start + CPU_ROWS_PER_MATMUL)
        if bias is None or scale is not None:  # an int8 layer's bias comes after its scale
            torch.mm(x[rows], weight_t, out=out[rows])
        else:
            torch.addmm(bias, x[rows], weight_t, out=out[rows])
    if scale is not None:  # what Int8Linear.forward computes past its fused kernel's rows, row for row
        out *= scale
        if bias is not None:
            out += bias
    return out


def _dense_weight(linear: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """The (out, in) weight in x's dtype that a long call multiplies by, the per-channel scale to
    apply after it (an int8 layer's, models/quant.py: its weight cast once for all the calls, not
    once a call) and the bias; None for a layer of another kind."""
    bias = getattr(linear, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    if isinstance(linear, nn.Linear):
        return linear.weight, None, bias
    weight_int8, scale = getattr(linear, "weight_int8", None), getattr(linear, "scale", None)
    if isinstance(weight_int8, torch.Tensor) and isinstance(scale, torch.Tensor) and scale.dtype == x.dtype:
        return weight_int8.to(x.dtype), scale, bias
    return None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and x.dtype == self.weight.dtype:
            if has_cpu_kernels(x):
                return torch.ops.tandem.rms_norm(x, self.weight, self.eps)  # the same computation in one call
            if fused_triton.serves(x):
                return fused_triton.rms_norm(x, self.weight, self.eps)  # on a GPU: one launch, not eight
        # Statistics in float32 (bf16 sums of squares drift), scaled in the model's dtype as
        # Hugging Face does, so logits match theirs.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul (rows [gate; up]): act is
    silu (SwiGLU, Llama's) or gelu with the tanh approximation (GeGLU, Gemma's)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        # nn.Module, not nn.Linear: quant.quantize_model may swap in an Int8Linear
        self.gate_up_proj: nn.Module = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj: nn.Module = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(self.gate_up_proj, "silu_mul", None)  # models/packed.PackedLinear's, on AMX tiles
        if self.activation == "silu" and fused is not None and (act := fused(x)) is not None:
            return project(self.down_proj, act)
        gate_up = project(self.gate_up_proj, x)
        if self.activation == "gelu_tanh":
            gate, up = gate_up.chunk(2, dim=-1)
            return project(self.down_proj, F.gelu(gate, approximate="tanh") * up)
        if gate_up.dim() == 2 and has_cpu_kernels(gate_up):
            return project(self.down_proj, torch.ops.tandem.silu_mul(gate_up))  # torch's bits, one call
        if fused_triton.serves(gate_up):
            return project(self.down_proj, fused_triton.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return project(self.down_proj, F.silu(gate) * up)
