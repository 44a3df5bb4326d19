"""Weight-only int8: the projections of every attention and MLP block kept as int8 in memory, so
a decode step reads about half the bytes of bf16.

Each output channel (row of a Linear's weight) has its own scale, absmax / 127 of that row,
stored in the model's dtype; the row is round(w / scale), clamped to [-127, 127]. The layer
computes x @ (w_int8 * scale).T (+ bias) with a fused kernel that dequantizes while it
multiplies: on a CPU with AVX512-BF16 and bf16 activations, the C++ kernels' int8_mm (bf16 dot
products, the weight read once for all the rows); on a GPU with triton, up to
int8_triton.MAX_ROWS rows, a triton kernel that widens the weight as it loads it; elsewhere
torch's kernel `_weight_int8pack_mm`, which pays per row of x: faster than the bf16 matmul at one
row, slower after a few. Above those bounds (prefill chunks, big batches) and on devices without a
kernel the layer multiplies by the int8 weight cast to the dtype and scales the result instead:
the same product, slower than the bf16 matmul on a CPU.

Embeddings, norms and the lm_head stay in the model's dtype: the embedding is a lookup (a decode
step reads one row), and the logits are where int8 error shows most.

A transformation of a plain model, not a model variant: the forward code is unchanged, only its
Linear modules are swapped. The loader swaps them while the model is still empty
(quantized_empty) and quantizes each slice of the checkpoint as it reads it
(checkpoint_names.load_tensors), so no process holds the model's projections in its dtype;
quantize_model does the same to a model already loaded. Both also make fp8 projections
("fp8": models/fp8.py's Fp8Linear, e4m3 weights with a float32 scale per row).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_extension, int8_triton
from tandem.models.files import Quantization
from tandem.models.fp8 import Fp8Linear
from tandem.models.llama import LlamaForCausalLM

INT8_MAX = 127
# Rows of x up to which the fused kernel beats casting the weight for a dense matmul. Its cost grows
# with the rows; the cast's hardly does. Measured on the SmolLM2 shapes (bf16, AVX512-BF16 CPU,
# 1 and 2 threads), the two meet near 12 rows for every shape.
INT8_KERNEL_MAX_ROWS = 12
KERNEL_OP = "aten::_weight_int8pack_mm"


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (int8 weight (out, in), scale (out,) in the weight's dtype), with
    weight ≈ int8 * scale[:, None]. The int8 values are rounded against the stored scale, so the
    dequantized weight is exactly int8 * scale. An all-zero row gets scale 1 (its values are 0)."""
    w32 = weight.detach().float()
    absmax = w32.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax)).to(weight.dtype)
    q = torch.round(w32 / scale.float()[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale


def has_int8_kernel(device: torch.device) -> bool:
    if device.type == "meta":  # an empty model's layer: asked again once it is on its device (quantized_empty)
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(KERNEL_OP, device.type.upper())


def _cpu_int8_kernel_serves(rows: torch.Tensor) -> bool:
    return rows.device.type == "cpu" and _int8_mm_serves(rows.shape[1], rows.dtype)


@functools.cache
def _int8_mm_serves(in_features: int, dtype: torch.dtype) -> bool:
    """Asked once per shape and dtype, not on every forward (a dispatcher call each)."""
    return cpu_extension.load() and bool(torch.ops.tandem.int8_mm_supported(INT8_KERNEL_MAX_ROWS, in_features, dtype))


class Int8Linear(nn.Module):
    """A bias-optional Linear whose weight is int8 with one scale per output channel."""

    weight_int8: torch.Tensor  # (out, in) int8
    scale: torch.Tensor  # (out,) in the model's dtype

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight_int8.shape[1]
        self.out_features = weight_int8.shape[0]
        # Buffers, not parameters: nothing trains them, and the engine reads the model's dtype
        # from its parameters.
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.has_kernel = has_int8_kernel(weight_int8.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        weight_int8, scale = quantize_int8(linear.weight)
        return cls(weight_int8, scale, linear.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """(out, in) weight_int8 * scale in the scale's dtype: what this layer multiplies by."""
        return self.weight_int8.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != self.scale.dtype:
            rows = rows.to(self.scale.dtype)
        if int8_triton.serves(rows):
            out = int8_triton.int8_mm(rows.contiguous(), self.weight_int8, self.scale)
        elif self.has_kernel and rows.shape[0] <= INT8_KERNEL_MAX_ROWS:
            if _cpu_int8_kernel_serves(rows):  # for every row count up to the bound alike: a row's bits its own
                out = torch.ops.tandem.int8_mm(rows.contiguous(), self.weight_int8, self.scale)
            else:
                out = torch._weight_int8pack_mm(rows.contiguous(), self.weight_int8, self.scale)
        else:
            out = F.linear(rows, self.weight_int8.to(rows.dtype)) * self.scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


@torch.no_grad()
def quantize_model(model: LlamaForCausalLM, quantization: Quantization) -> LlamaForCausalLM:
    """The model with every attention and MLP Linear replaced by an Int8Linear ("int8") or an
    Fp8Linear ("fp8", models/fp8.py), in place; "none" returns it unchanged."""
    if quantization == "none":
        return model
    model.swap_projections(_int8 if quantization == "int8" else _fp8)
    return model


def _int8(module: nn.Module) -> Int8Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"expected an nn.Linear to quantize, got {type(module).__name__}")
    return Int8Linear.from_linear(module)


def _fp8(module: nn.Module) -> Fp8Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"expected an nn.Linear to quantize, got {type(module).__name__}")
    return Fp8Linear.from_linear(module)


def quantized_empty(model: LlamaForCausalLM, quantization: Quantization, device: torch.device | str) -> LlamaForCausalLM:
    """`model` built on the meta device (LlamaForCausalLM.empty(..., "meta", ...)) made empty on
    `device`, with every attention and MLP Linear an empty Int8Linear ("int8") or Fp8Linear ("fp8")
    for the loader to fill: nothing is allocated for the projections but their 8-bit rows and scales."""
    if quantization == "int8":
        model.swap_projections(_empty_int8)
    elif quantization == "fp8":
        model.swap_projections(_empty_fp8)
    model = model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.has_kernel = has_int8_kernel(torch.device(device))
    return model


def _empty_int8(module: nn.Module) -> Int8Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"expected an nn.Linear to quantize, got {type(module).__name__}")
    weight = module.weight
    weight_int8 = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    return Int8Linear(weight_int8, torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device), module.bias)


def _empty_fp8(module: nn.Module) -> Fp8Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"expected an nn.Linear to quantize, got {type(module).__name__}")
    return Fp8Linear.empty_like(module)
