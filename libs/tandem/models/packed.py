"""Projections packed once for the CPU kernel that multiplies any number of rows with every row's
bits its own (torch.ops.tandem.packed_mm, kernels/cpu_paged.cpp; AVX512-BF16): bf16 weights, and
int8 ones with their scales (models/quant.py), widened to bf16 a tile at a time in the kernel.

On this machine's shapes (SmolLM2-135M's 120 projections, 2 threads, weights from memory) it takes
7.2 ms at 1 row against 25.5 ms for torch's bf16 matmul, 8.2 against 27.6 at 8, 22 against 41 at
32 and 74 against 104 at 128: oneDNN reads a bf16 weight for a few rows at a third of the
memory's rate and is slower at every row count we run. Its sums are also one chain per output in
k order, so a row gets the same bits alone, among a decode batch or a prefill chunk's rows (no
splitting of long calls and no doubled single rows, as layers.project does for oneDNN).

The tied logits take the same path: a packed copy of the embedding (56 MB for SmolLM2), since the
lookup needs the embedding's own layout.

An int8 layer packed this way computes what Int8Linear computes (x @ (w8 * scale).T, each sum
times its scale, then rounded) for every row count, where Int8Linear has two paths (a fused
kernel up to 12 rows, a cast weight and oneDNN above) whose bits differ.

A transformation of a loaded model (pack_model), like quant.quantize_model after which it runs:
the forward code is unchanged, its bf16 nn.Linear and Int8Linear projections are swapped.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels import cpu_extension
from tandem.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tandem.models.quant import Int8Linear


def can_pack(weight: torch.Tensor) -> bool:
    """A (out, in) weight that packed_mm serves here: bf16 or int8 on a CPU with the kernels and AVX512-BF16."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and cpu_extension.load()
        and bool(torch.ops.tandem.packed_mm_supported(weight.shape[0], weight.shape[1], weight.dtype))
    )


def packed_linear(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) bf16 @ W.T, W packed by pack_weight (int8 ones times `scale`): (..., out)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.ops.tandem.packed_mm(rows, weight_packed, scale)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) bf16 or int8 -> packed_mm's layout, (out / 16, in / 2, 32) of the same type."""
    return torch.ops.tandem.pack_weight(weight.detach().contiguous())


class PackedLinear(nn.Module):
    """A bias-optional Linear whose weight is kept only packed: bf16, or int8 with a bf16 scale per
    output channel."""

    gives_rows_their_own_bits = True  # layers.project calls it once, with all its rows
    weight_packed: torch.Tensor  # (out / 16, in / 2, 32) bf16 or int8
    scale: torch.Tensor | None  # (out,) bf16, for int8 weights

    def __init__(
        self, weight_packed: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, in_features: int, out_features: int
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # Buffers, not parameters: nothing trains them. The engine reads the model's dtype from its
        # parameters; the norms' and the embedding's remain.
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(pack_weight(linear.weight), None, linear.bias, linear.in_features, linear.out_features)

    @classmethod
    def from_int8(cls, layer: Int8Linear) -> PackedLinear:
        return cls(pack_weight(layer.weight_int8), layer.scale, layer.bias, layer.in_features, layer.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        out = packed_linear(x, self.weight_packed, self.scale)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kind = "int8" if self.scale is not None else "bf16"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed {kind}"


@torch.no_grad()
def pack_model(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The model with every bf16 attention and MLP projection (nn.Linear or Int8Linear with bf16
    scales) that packed_mm serves here replaced by a PackedLinear, and its logits computed from a
    packed copy of their weight, in place; the model unchanged elsewhere (a GPU, float32, a CPU
    without AVX512-BF16)."""
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)  # a ModuleList yields plain Modules to the type checker
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _packed(attn.qkv_proj)
        attn.o_proj = _packed(attn.o_proj)
        mlp.gate_up_proj = _packed(mlp.gate_up_proj)
        mlp.down_proj = _packed(mlp.down_proj)
    logits_weight = model.logits_weight()
    if can_pack(logits_weight):
        model.pack_logits(pack_weight(logits_weight))
    return model


def _packed(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Linear) and module.weight.dtype == torch.bfloat16 and can_pack(module.weight):
        return PackedLinear.from_linear(module)
    if isinstance(module, Int8Linear) and module.scale.dtype == torch.bfloat16 and can_pack(module.weight_int8):
        return PackedLinear.from_int8(module)
    return module
