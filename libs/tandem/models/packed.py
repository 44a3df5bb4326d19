"""Projections packed once for the CPU kernel that multiplies any number of rows with every row's
bits its own (torch.ops.tandem.packed_mm, kernels/cpu/packed_mm.cpp), in the model's dtype: bf16 rows
on a CPU with AVX512-BF16 (bf16 dot products), float32 rows on one with AVX2 and FMA; bf16 or
float32 weights as the rows, and int8 ones with their scales (models/quant.py), widened in the
kernel a tile at a time.

On SmolLM2-135M's projections it is faster than torch's matmul at every row count measured, in
bf16 on an AVX512-BF16 Xeon (most of all for a few rows: oneDNN reads a bf16 weight for a few
rows at a fraction of the memory's rate) and in float32 on an AVX2 EPYC; int8 weights faster
still at one row. Its sums are also one chain per output in k order, so a row gets the same bits alone, among a
decode batch or a prefill chunk's rows (no splitting of long calls and no doubled single rows, as
layers.project does for torch's matmul).

The tied logits take the same path: a packed copy of the embedding (56 MB for SmolLM2 in bf16,
113 MB in float32), since the lookup needs the embedding's own layout.

An int8 layer packed this way computes what Int8Linear computes (x @ (w8 * scale).T, each sum
times its scale, then rounded) for every row count, where Int8Linear has two paths (a fused
kernel up to 12 rows, a cast weight and oneDNN above) whose bits differ.

A transformation of a loaded model (pack_model), like quant.quantize_model after which it runs:
the forward code is unchanged, its nn.Linear and Int8Linear projections are swapped. It also
gives the model a PackedDecode, which runs a decode-only step's layers in one C++ call (the same
kernels and ops in the same order) instead of a Python call per op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from tandem.kernels import cpu_extension
from tandem.kernels.attention_cpu import kernels_take, paged_attention_cpu
from tandem.kernels.gemm_choice import BUCKETS, PACKED_KERNEL_CODES, GemmChooser, GemmShape, bucket_of, cache_path, candidates, describe
from tandem.kernels.metadata import AttentionMetadata
from tandem.models.config import ModelConfig
from tandem.models.layers import project
from tandem.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, StepCut
from tandem.models.quant import Int8Linear

log = logging.getLogger(__name__)

# A decode step that may be cut short (LlamaModel.should_cut, set for a step with free or
# background rows) runs its layers this many to a call and is asked between calls: a paid request
# arriving during a step of free decodes waits for at most a fifth of SmolLM2's 30 layers.
CUT_CHECK_LAYERS = 6
_WEIGHTS_PER_LAYER, _SCALES_PER_LAYER = 6, 4  # decode_layers' lists


def can_pack(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """A (out, in) weight that packed_mm serves here for rows of `dtype` (on a CPU with the kernels:
    bf16 rows with AVX512-BF16, float32 rows with AVX2)."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and cpu_extension.load()
        and bool(torch.ops.tandem.packed_mm_supported(weight.shape[0], weight.shape[1], weight.dtype, dtype))
    )


def packed_linear(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor | None = None, kernel: int = 0) -> torch.Tensor:
    """x (..., in) @ W.T, W packed by pack_weight for x's dtype (int8 ones times `scale`), by
    packed_mm's `kernel` (gemm_choice.PACKED_KERNEL_CODES): (..., out)."""
    if x.dim() == 2 and x.stride(-1) == 1:  # a model's rows, as they come: no reshapes
        return torch.ops.tandem.packed_mm(x, weight_packed, scale, kernel)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.ops.tandem.packed_mm(rows, weight_packed, scale, kernel)
    return out.reshape(*x.shape[:-1], out.shape[-1])


ONEDNN = -1  # a PackedLinear's kernel code for torch's matmul on its dense weight


def kernel_codes(kernels: tuple[str, ...]) -> tuple[int, ...]:
    """gemm_choice's kernel names per bucket -> packed_mm's kernel codes (ONEDNN for onednn)."""
    return tuple(PACKED_KERNEL_CODES.get(name, ONEDNN) for name in kernels)


def pack_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(out, in) weight -> packed_mm's layout for rows of `dtype`, of the weight's type: (out / 16,
    in / 2, 32) for bf16 rows, (out / 16, in, 16) for float32 ones."""
    return torch.ops.tandem.pack_weight(weight.detach().contiguous(), dtype)


class PackedLinear(nn.Module):
    """A bias-optional Linear whose weight is kept only packed: in the model's dtype (bf16 or
    float32), or int8 with a scale per output channel in that dtype."""

    gives_rows_their_own_bits = True  # layers.project calls it once, with all its rows (forward splits them where it must)
    weight_packed: torch.Tensor  # pack_weight's, bf16, float32 or int8
    scale: torch.Tensor | None  # (out,) in the model's dtype, for int8 weights
    # packed_mm's kernel per bucket of rows (gemm_choice.BUCKETS), ONEDNN for torch's matmul on `dense`
    kernels: tuple[int, ...]
    dense: nn.Linear | None  # the weight unpacked, where a bucket's kernel is onednn (a submodule: set in __init__, no class default)

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
        self.kernels = (0,) * len(BUCKETS)  # packed_mm's dot products until use_kernels
        self.dense = None

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
        kernel = self.kernels[bucket_of(x.numel() // x.shape[-1])]
        if kernel == ONEDNN and self.dense is not None:
            out = project(self.dense, x)  # in calls of a batch's bits (layers.project)
        else:
            out = packed_linear(x, self.weight_packed, self.scale, max(kernel, 0))
        return out if self.bias is None else out + self.bias

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this gate/up projection (gate's channels first) for rows x in one pass
        (packed_mm_silu), where their bucket's kernel is AMX and the weight bf16: the bits of
        silu_mul(self(x)), without writing and reading back its (rows, 2 intermediate) product. None
        where it does not serve them."""
        amx = PACKED_KERNEL_CODES["amx"]
        if self.scale is not None or self.bias is not None or x.dim() != 2 or x.dtype != self.dtype or x.stride(-1) != 1:
            return None
        if self.kernels[bucket_of(x.shape[0])] != amx:
            return None
        return torch.ops.tandem.packed_mm_silu(x, self.weight_packed)

    def use_kernels(self, kernels: tuple[str, ...]) -> None:
        """Serve each bucket of rows by gemm_choice's kernel for it; onednn keeps a dense copy of
        the weight (bf16 or float32 weights only: int8 ones are not a oneDNN candidate)."""
        codes = kernel_codes(kernels)
        if ONEDNN in codes and self.scale is not None:
            raise ValueError("an int8 PackedLinear has no oneDNN kernel")
        if ONEDNN in codes and self.dense is None:
            dense = nn.Linear(self.in_features, self.out_features, bias=False, dtype=self.dtype)
            dense.weight = nn.Parameter(unpack_weight(self.weight_packed, self.dtype), requires_grad=False)
            self.dense = dense
        elif ONEDNN not in codes:
            self.dense = None
        self.kernels = codes

    def extra_repr(self) -> str:
        kind = "int8" if self.scale is not None else str(self.dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed {kind}"


def unpack_weight(weight_packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pack_weight's inverse for a bf16 or float32 weight: the (out, in) weight."""
    groups, rows, width = weight_packed.shape
    if dtype == torch.float32:  # (out / 16, in, 16)
        return weight_packed.permute(0, 2, 1).reshape(groups * width, rows).contiguous()
    # (out / 16, in / 2, 32): per pair of inputs, 16 channels' two weights side by side
    return weight_packed.reshape(groups, rows, width // 2, 2).permute(0, 2, 1, 3).reshape(groups * width // 2, rows * 2).contiguous()


@torch.no_grad()
def pack_model(model: LlamaForCausalLM, gemm: GemmChooser | None = None) -> LlamaForCausalLM:
    """The model with every attention and MLP projection (nn.Linear or Int8Linear) that packed_mm
    serves here for rows of the model's dtype replaced by a PackedLinear, and its logits computed
    from a packed copy of their weight, in place; the model unchanged elsewhere (a GPU, bf16 on a
    CPU without AVX512-BF16, a CPU without AVX2). Each projection's kernel per bucket of rows is
    `gemm`'s choice (kernels/gemm_choice.py; None: this machine's timings under the `auto` policy)."""
    model.swap_projections(_packed)
    logits_weight = model.logits_weight()
    if can_pack(logits_weight, logits_weight.dtype):
        model.pack_logits(pack_weight(logits_weight, logits_weight.dtype))
    choose_kernels(model, gemm)
    # decode_layers runs every layer in one call, Llama's own: no all-reduce between them, none
    # of another architecture's differences (ModelConfig.plain_layers), no fp8 KV scales
    if model.tp.size == 1 and model.config.plain_layers and not _has_kv_scales(model):
        model.model.fast_decode = PackedDecode(model.model, model.config)
    return model


def choose_kernels(model: LlamaForCausalLM, gemm: GemmChooser | None = None) -> GemmChooser | None:
    """Gives every packed projection and the packed logits of a packed model `gemm`'s kernel per
    bucket of rows (None: this machine's timings under the `auto` policy); the chooser used, None
    where nothing is packed. The one-call decode sees the change at its next step."""
    projections = [module for module in model.modules() if isinstance(module, PackedLinear)]
    logits_packed = getattr(model, "logits_packed", None)
    if not projections and not isinstance(logits_packed, torch.Tensor):
        return None
    gemm = gemm or GemmChooser("auto", path=cache_path())
    for projection in projections:
        shape = GemmShape(projection.out_features, projection.in_features, projection.weight_packed.dtype, projection.dtype)
        projection.use_kernels(gemm.kernels(shape, candidates(shape)))
    if isinstance(logits_packed, torch.Tensor):
        weight = model.logits_weight()
        shape = GemmShape(weight.shape[0], weight.shape[1], logits_packed.dtype, logits_packed.dtype)
        model.pack_logits(logits_packed, kernel_codes(gemm.kernels(shape, candidates(shape))))
    for line in describe(gemm):
        log.info("kernels (%s): %s", gemm.policy, line)
    return gemm


def _has_kv_scales(model: LlamaForCausalLM) -> bool:
    """A layer's fp8 KV cache scales (a checkpoint's k_scale, v_scale) are not 1: the model folds
    them around attention, which decode_layers does not."""
    return any(
        layer.self_attn.k_scale != 1.0 or layer.self_attn.v_scale != 1.0
        for layer in model.model.layers
        if isinstance(layer, LlamaDecoderLayer)
    )


# decode_layers' weights and scales, and per bucket of rows its kernel per projection (None: torch's
# matmul serves one of them, which decode_layers does not call)
_Served = tuple[list[torch.Tensor], list[torch.Tensor | None], list[list[int] | None]]


class PackedDecode:
    """A decode-only step's decoder layers in one call of torch.ops.tandem.decode_layers, where
    every layer's projections are bias-free PackedLinears of the step's dtype and its attention
    the CPU kernels': the same ops in the same order as LlamaModel's layers, so the same bits,
    without Python between them (a SmolLM2 batch-1 step was faster so, bf16 and int8, alternated
    in one process). None where it does not serve, and the layers run as written.

    The list of weights the call takes is built once and kept while every layer has the modules,
    attention and norm weights it was built from; tests and backends swap those, and a swap is
    seen at the next step. Building it every step cost a visible share of a batch-1 step on a
    CPU; checking it is a few microseconds."""

    def __init__(self, model: LlamaModel, config: ModelConfig) -> None:
        self._model = model
        self._config = config
        # (the objects it was built from, the step's dtype, the weights and scales or None)
        self._built: tuple[tuple[object, ...], torch.dtype, _Served | None] | None = None

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        should_cut: Callable[[], bool] | None = None,
    ) -> torch.Tensor | None:
        """The layers' output, or None where this does not serve; with `should_cut`, the layers
        CUT_CHECK_LAYERS to a call, raising StepCut between calls when it says so."""
        if not (h.is_cpu and h.dim() == 2 and kernels_take(h.dtype, kv_cache.dtype) and cpu_extension.load()):
            return None
        served = self._weights(h.dtype)
        if served is None:
            return None
        weights, scales, kernels_by_bucket = served
        kernels = kernels_by_bucket[bucket_of(h.shape[0])]
        if kernels is None:  # a projection's kernel for these rows is torch's: the layers as written
            return None
        if should_cut is None:
            return self._layers(h, weights, scales, kernels, cos, sin, kv_cache, meta)
        num_layers = len(weights) // _WEIGHTS_PER_LAYER
        for first in range(0, num_layers, CUT_CHECK_LAYERS):
            if should_cut():
                raise StepCut
            end = min(first + CUT_CHECK_LAYERS, num_layers)
            h = self._layers(
                h,
                weights[first * _WEIGHTS_PER_LAYER : end * _WEIGHTS_PER_LAYER],
                scales[first * _SCALES_PER_LAYER : end * _SCALES_PER_LAYER],
                kernels[first * _SCALES_PER_LAYER : end * _SCALES_PER_LAYER],
                cos,
                sin,
                kv_cache.narrow(1, first, end - first),
                meta,
            )
        return h

    def _layers(
        self,
        h: torch.Tensor,
        weights: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        kernels: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        c = self._config
        return torch.ops.tandem.decode_layers(
            h, weights, scales, kernels, cos, sin, kv_cache, meta.slot_mapping, meta.seq_lens, meta.block_tables,
            c.num_heads, c.num_kv_heads, c.attention_scale, c.rms_norm_eps,
        )  # fmt: skip

    def _weights(self, dtype: torch.dtype) -> _Served | None:
        """decode_layers' weights, scales and kernels for rows of `dtype`, or None where it does not
        serve the layers as they are now."""
        sources = self._sources()
        built = self._built
        if (
            built is None
            or built[1] != dtype
            or len(built[0]) != len(sources)
            or any(a is not b for a, b in zip(built[0], sources, strict=True))
        ):
            built = self._built = (sources, dtype, self._build(dtype))
        return built[2]

    def _sources(self) -> tuple[object, ...]:
        """Every object the weights list is made from, read without nn.Module's attribute lookup
        (its slow path costs what the check is meant to save)."""
        sources: list[object] = []
        for layer in self._model.layers:
            parts = layer._modules
            attn, mlp = parts["self_attn"], parts["mlp"]
            assert (
                attn is not None
                and mlp is not None
                and parts["input_layernorm"] is not None
                and parts["post_attention_layernorm"] is not None
            )
            projections, feed_forward = attn._modules, mlp._modules
            sources += tuple(getattr(p, "kernels", None) for p in (*projections.values(), *feed_forward.values()))
            sources += (
                projections["qkv_proj"], projections["o_proj"], feed_forward["gate_up_proj"], feed_forward["down_proj"], attn.attention,
                parts["input_layernorm"]._parameters["weight"], parts["post_attention_layernorm"]._parameters["weight"],
            )  # fmt: skip
        return tuple(sources)

    def _build(self, dtype: torch.dtype) -> _Served | None:
        weights: list[torch.Tensor] = []
        scales: list[torch.Tensor | None] = []
        kernels: list[tuple[int, ...]] = []  # per projection, its kernel per bucket
        for layer in self._model.layers:
            assert isinstance(layer, LlamaDecoderLayer)  # a ModuleList yields plain Modules to the type checker
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = (_served(p, dtype) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if qkv is None or o is None or gate_up is None or down is None or attn.attention is not paged_attention_cpu:
                return None
            if norms[0].dtype != dtype or norms[1].dtype != dtype:
                return None
            weights += (norms[0], qkv.weight_packed, o.weight_packed, norms[1], gate_up.weight_packed, down.weight_packed)
            scales += (qkv.scale, o.scale, gate_up.scale, down.scale)
            kernels += (qkv.kernels, o.kernels, gate_up.kernels, down.kernels)
        by_bucket = [[codes[b] for codes in kernels] for b in range(len(BUCKETS))]
        return weights, scales, [None if ONEDNN in codes else codes for codes in by_bucket]


def _served(projection: nn.Module, dtype: torch.dtype) -> PackedLinear | None:
    """The projection, where decode_layers multiplies by it as its forward does."""
    if isinstance(projection, PackedLinear) and projection.bias is None and projection.dtype == dtype:
        return projection
    return None


def _packed(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Linear) and can_pack(module.weight, module.weight.dtype):
        return PackedLinear.from_linear(module)
    if isinstance(module, Int8Linear) and can_pack(module.weight_int8, module.scale.dtype):
        return PackedLinear.from_int8(module)
    return module
