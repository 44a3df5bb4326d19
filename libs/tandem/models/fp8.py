"""Weight-only FP8: the projections of every attention and MLP block kept as float8_e4m3fn in
memory, a byte a weight as int8 is, with the finer steps of a float near zero.

Each output channel (row of a Linear's weight) has its own float32 scale, absmax / 448 of that
row (448 is e4m3's largest value); the row is w / scale rounded to e4m3. A pre-quantized
checkpoint (compressed-tensors, models/compressed_tensors.py) brings its fp8 rows and scales
as they are, a per-tensor scale given to every row of its tensor. The layer computes
x @ (w_fp8 * scale).T (+ bias), in x's dtype:
- on a CPU with AVX512F, for bf16 or float32 rows, the C++ kernels' fp8_mm, which widens the
  weight as it loads it and scales each sum (kernels/cpu/fp8_mm.cpp), for any number of rows: a
  row's bits its own in any company. Casting the weight for oneDNN's matmul instead was slower at
  every row count up to 128 on the SmolLM2 shapes (torch widens fp8 slowly on a CPU); the kernel
  is not fast at many rows either: 128 rows took about 5x the bf16 model's oneDNN matmul (on
  an AMX-BF16 Xeon core, 1 thread), so a long prefill costs more than in bf16 (decode is what it is for);
- on a GPU of compute capability 8.9 or more (Ada, Hopper), torch._scaled_mm: each row of x
  quantized to e4m3 with its own scale (absmax / 448 of the row), fp8 times fp8 on the tensor
  cores, the two scales applied to the float32 sums (on 9.0 and up inside the matmul, row-wise);
- elsewhere, a matmul by the weight dequantized to x's dtype, the same weight a reference model
  holding w_fp8 * scale has.

Embeddings, norms and the lm_head stay in the model's dtype, as with int8 (models/quant.py, which
swaps these layers in: quantized_empty for the loader, quantize_model for a loaded model).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_extension

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALED_MM_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9) and Hopper (9.0)
ROWWISE_CAPABILITY = (9, 0)  # _scaled_mm's row-wise scales


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (float8_e4m3fn weight (out, in), scale (out,) float32), with
    weight ≈ fp8 * scale[:, None]. An all-zero row gets scale 1 (its values are 0)."""
    w32 = weight.detach().float()
    absmax = w32.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # the cast does not saturate: clamp first
    return q.contiguous(), scale


@functools.cache
def _cpu_kernel_serves(in_features: int, dtype: torch.dtype) -> bool:
    """Asked once per shape and dtype, not on every forward (a dispatcher call each)."""
    return cpu_extension.load() and bool(torch.ops.tandem.fp8_mm_supported(1, in_features, dtype))


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device_index)
    return major, minor


def scaled_mm_serves(rows: torch.Tensor, out_features: int) -> bool:
    """torch._scaled_mm multiplies these rows by an fp8 weight here: a GPU with fp8 tensor cores,
    and sizes it takes (in and out features multiples of 16)."""
    return (
        rows.is_cuda
        and rows.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and rows.shape[1] % 16 == 0
        and out_features % 16 == 0
        and _capability(rows.device.index or 0) >= SCALED_MM_CAPABILITY
    )


def scaled_mm(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """rows (M, in) @ (weight (out, in) fp8 * scale (out,)).T in rows' dtype, each row quantized to
    e4m3 with its own scale; `rowwise`: both scales applied inside the matmul (CUDA 9.0 and up),
    else to its float32 output (the one form torch's CPU _scaled_mm takes too)."""
    x32 = rows.float()
    x_scale = (x32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    xq = (x32 / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if rowwise:
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
        return out.to(rows.dtype)
    one = torch.ones((), device=rows.device, dtype=torch.float32)
    out = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (out * x_scale * scale).to(rows.dtype)


class Fp8Linear(nn.Module):
    """A bias-optional Linear whose weight is float8_e4m3fn with one float32 scale per output channel."""

    weight_fp8: torch.Tensor  # (out, in) float8_e4m3fn
    scale: torch.Tensor  # (out,) float32

    def __init__(self, weight_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight_fp8.shape[1]
        self.out_features = weight_fp8.shape[0]
        # Buffers, not parameters: nothing trains them, and the engine reads the model's dtype
        # from its parameters.
        self.register_buffer("weight_fp8", weight_fp8)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        weight_fp8, scale = quantize_fp8(linear.weight)
        return cls(weight_fp8, scale, linear.bias)

    @classmethod
    def empty_like(cls, linear: nn.Linear) -> Fp8Linear:
        """An Fp8Linear of the Linear's shape, bias and device, its values unset (for the loader)."""
        weight = linear.weight
        return cls(
            torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device),
            torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device),
            linear.bias,
        )

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """(out, in) weight_fp8 * scale, computed in float32 and rounded once to `dtype`."""
        return (self.weight_fp8.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.is_cpu and _cpu_kernel_serves(self.in_features, rows.dtype):
            out = torch.ops.tandem.fp8_mm(rows, self.weight_fp8, self.scale)
        elif scaled_mm_serves(rows, self.out_features):
            out = scaled_mm(rows, self.weight_fp8, self.scale, _capability(rows.device.index or 0) >= ROWWISE_CAPABILITY)
        else:
            out = F.linear(rows, self.dequantized_weight(rows.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"
