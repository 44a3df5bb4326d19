"""An int8 weight-only product on a GPU in one triton launch (int8_triton_kernel): x @ (w8 *
scale).T, each int8 weight widened as it is loaded, so a decode step reads the int8 bytes and no
widened copy of the weight is made. Without it a CUDA decode step took torch's
_weight_int8pack_mm, whose CUDA kernel made SmolLM2's batch-1 step several times slower than bf16
(on an H200, CUDA graphs on both).

Int8Linear calls it for CUDA rows up to MAX_ROWS when triton is installed (`serves`); more rows
(prefill chunks, big decode batches) multiply by the weight cast to the dtype, where cuBLAS's
dense matmul is the faster. Importing this module does not import triton; the first call does. It
runs on CPU tensors in triton's interpreter (TRITON_INTERPRET=1 when first loaded), which is how
the tests check it on a machine without a GPU.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from tandem.kernels.fused_triton import is_triton_available

MAX_ROWS = 64  # rows up to which Int8Linear takes the kernel on a GPU
# One launch configuration for every row count, so a row's sums are the same whatever the rows
# beside it. Chosen on an H200 over SmolLM2's four projection shapes, a layer's four calls as a
# decode step meets them (30 layers' weights in turn, from memory, replayed from a CUDA graph):
# faster at 1, 8 and 64 rows than 32 channels by 64 inputs with 4 warps (the first choice), and
# close to cuBLAS's bf16 product. (256 inputs a step measured a little faster again, untested on
# a GPU so far.)
_BLOCK_M = 16  # rows per program: tl.dot's minimum
_BLOCK_N = 16  # output channels per program: more programs for the few channels of a projection
_BLOCK_K = 128  # inputs per loop iteration: fewer dependent loads along a row
_NUM_WARPS = 2
_NUM_STAGES = 3
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def serves(rows: torch.Tensor) -> bool:
    """Whether Int8Linear takes the kernel for these (rows, in) activations: CUDA, triton
    installed, at most MAX_ROWS rows of a floating dtype the kernel takes."""
    return rows.is_cuda and rows.shape[0] <= MAX_ROWS and rows.dtype in _DTYPES and is_triton_available()


def int8_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ (weight (N, K) int8 * scale (N,)[:, None]).T in x's dtype: each output one float32
    sum, times its scale, rounded once."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in _DTYPES:
        raise ValueError(
            f"int8_mm: x {tuple(x.shape)} {x.dtype} (strides {x.stride()}): (rows, in) floats with a unit-stride last dimension"
        )
    if weight.dim() != 2 or weight.dtype != torch.int8 or not weight.is_contiguous() or weight.shape[1] != x.shape[1]:
        raise ValueError(f"int8_mm: weight {tuple(weight.shape)} {weight.dtype}: a contiguous int8 (out, {x.shape[1]})")
    if scale.shape != (weight.shape[0],) or scale.dtype != x.dtype or not scale.is_contiguous():
        raise ValueError(f"int8_mm: scale {tuple(scale.shape)} {scale.dtype}: ({weight.shape[0]},) in x's dtype")
    num_rows, num_cols = x.shape[0], weight.shape[0]
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_rows and num_cols:
        grid = (-(-num_cols // _BLOCK_N), -(-num_rows // _BLOCK_M))
        _kernels().int8_mm_kernel[grid](
            x, weight, scale, out, num_rows, num_cols, x.stride(0), out.stride(0),
            NUM_INPUTS=x.shape[1], BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, IEEE=x.dtype == torch.float32,
            num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
        )  # fmt: skip
    return out


@functools.cache
def _kernels() -> ModuleType:
    from tandem.kernels import int8_triton_kernel

    return int8_triton_kernel
