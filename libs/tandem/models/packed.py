"""Projections packed once for the CPU kernel that multiplies any number of rows with every row's
bits its own (torch.ops.tandem.packed_mm, kernels/cpu_paged.cpp), in the model's dtype: bf16 rows
on a CPU with AVX512-BF16 (bf16 dot products), float32 rows on one with AVX2 and FMA; bf16 or
float32 weights as the rows, and int8 ones with their scales (models/quant.py), widened in the
kernel a tile at a time.

On SmolLM2-135M's 120 projections (2 threads, weights from memory), bf16 on an AVX512-BF16 Xeon:
7.2 ms at 1 row against 25.5 ms for torch's bf16 matmul, 8.2 against 27.6 at 8, 22 against 41 at
32 and 74 against 104 at 128 (oneDNN reads a bf16 weight for a few rows at a third of the
memory's rate). float32 on an AVX2 EPYC: 21 ms at 1 row and 22 at 2 against torch's 48 and 68,
31 against 71 at 8, 113 against 178 at 64, 756 against 957 at 512; int8 weights 6.7 ms at 1 row.
Its sums are also one chain per output in k order, so a row gets the same bits alone, among a
decode batch or a prefill chunk's rows (no splitting of long calls and no doubled single rows, as
layers.project does for torch's matmul).

The tied logits take the same path: a packed copy of the embedding (56 MB for SmolLM2 in bf16,
113 MB in float32), since the lookup needs the embedding's own layout.

An int8 layer packed this way computes what Int8Linear computes (x @ (w8 * scale).T, each sum
times its scale, then rounded) for every row count, where Int8Linear has two paths (a fused
kernel up to 12 rows, a cast weight and oneDNN above) whose bits differ.

A transformation of a loaded model (pack_model), like quant.quantize_model after which it runs:
the forward code is unchanged, its nn.Linear and Int8Linear projections are swapped.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels import cpu_extension
from tandem.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tandem.models.quant import Int8Linear


def can_pack(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """A (out, in) weight that packed_mm serves here for rows of `dtype` (on a CPU with the kernels:
    bf16 rows with AVX512-BF16, float32 rows with AVX2)."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and cpu_extension.load()
        and bool(torch.ops.tandem.packed_mm_supported(weight.shape[0], weight.shape[1], weight.dtype, dtype))
    )


def packed_linear(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ W.T, W packed by pack_weight for x's dtype (int8 ones times `scale`): (..., out)."""
    if x.dim() == 2 and x.stride(-1) == 1:  # a model's rows, as they come: no reshapes
        return torch.ops.tandem.packed_mm(x, weight_packed, scale)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.ops.tandem.packed_mm(rows, weight_packed, scale)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def pack_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(out, in) weight -> packed_mm's layout for rows of `dtype`, of the weight's type: (out / 16,
    in / 2, 32) for bf16 rows, (out / 16, in, 16) for float32 ones."""
    return torch.ops.tandem.pack_weight(weight.detach().contiguous(), dtype)


class PackedLinear(nn.Module):
    """A bias-optional Linear whose weight is kept only packed: in the model's dtype (bf16 or
    float32), or int8 with a scale per output channel in that dtype."""

    gives_rows_their_own_bits = True  # layers.project calls it once, with all its rows
    weight_packed: torch.Tensor  # pack_weight's, bf16, float32 or int8
    scale: torch.Tensor | None  # (out,) in the model's dtype, for int8 weights

    def __init__(
        self, weight_packed: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, in_features: int, out_features: int
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = weight_packed.dtype if scale is None else scale.dtype  # the rows'
        # Buffers, not parameters: nothing trains them. The engine reads the model's dtype from its
        # parameters; the norms' and the embedding's remain.
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        weight = linear.weight
        return cls(pack_weight(weight, weight.dtype), None, linear.bias, linear.in_features, linear.out_features)

    @classmethod
    def from_int8(cls, layer: Int8Linear) -> PackedLinear:
        return cls(pack_weight(layer.weight_int8, layer.scale.dtype), layer.scale, layer.bias, layer.in_features, layer.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        out = packed_linear(x, self.weight_packed, self.scale)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kind = "int8" if self.scale is not None else str(self.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed {kind}"


@torch.no_grad()
def pack_model(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The model with every attention and MLP projection (nn.Linear or Int8Linear) that packed_mm
    serves here for rows of the model's dtype replaced by a PackedLinear, and its logits computed
    from a packed copy of their weight, in place; the model unchanged elsewhere (a GPU, bf16 on a
    CPU without AVX512-BF16, a CPU without AVX2)."""
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)  # a ModuleList yields plain Modules to the type checker
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _packed(attn.qkv_proj)
        attn.o_proj = _packed(attn.o_proj)
        mlp.gate_up_proj = _packed(mlp.gate_up_proj)
        mlp.down_proj = _packed(mlp.down_proj)
    logits_weight = model.logits_weight()
    if can_pack(logits_weight, logits_weight.dtype):
        model.pack_logits(pack_weight(logits_weight, logits_weight.dtype))
    return model


def _packed(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Linear) and can_pack(module.weight, module.weight.dtype):
        return PackedLinear.from_linear(module)
    if isinstance(module, Int8Linear) and can_pack(module.weight_int8, module.scale.dtype):
        return PackedLinear.from_int8(module)
    return module
