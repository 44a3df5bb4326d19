"""The triton kernel of an int8 weight-only product on a GPU (int8_triton). Imports triton: load it
through tandem.kernels.int8_triton, whose wrapper checks the inputs and launches it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_mm_kernel(
    x_ptr, weight_ptr, scale_ptr, out_ptr, num_rows, num_cols, x_stride, out_stride,
    NUM_INPUTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """out[m, n] = (sum over k of x[m, k] * weight[n, k]) * scale[n], rounded once to out's dtype.
    One program per BLOCK_M rows by BLOCK_N output channels; each int8 weight widened to x's dtype
    (exact: |w| <= 127) as loaded, the sum in float32 over BLOCK_K inputs at a time in k order. A
    row's sums are its own: the same tile shapes whatever the number of rows. NUM_INPUTS is a
    compile-time constant (a model has a few), so the loop's trip count is known."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    inputs = tl.arange(0, BLOCK_K)
    is_row = rows < num_rows
    is_col = cols < num_cols
    x_rows = x_ptr + rows[:, None].to(tl.int64) * x_stride
    weight_cols = weight_ptr + cols[None, :].to(tl.int64) * NUM_INPUTS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, NUM_INPUTS, BLOCK_K):
        k = k0 + inputs
        is_k = k < NUM_INPUTS
        x = tl.load(x_rows + k[None, :], mask=is_row[:, None] & is_k[None, :], other=0.0)
        weight = tl.load(weight_cols + k[:, None], mask=is_col[None, :] & is_k[:, None], other=0).to(x.dtype)
        # float32 rows: full-precision products, not TF32
        acc = tl.dot(x, weight, acc, input_precision="ieee") if IEEE else tl.dot(x, weight, acc)
    scale = tl.load(scale_ptr + cols, mask=is_col, other=0.0).to(tl.float32)
    out = (acc * scale[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :], out, mask=is_row[:, None] & is_col[None, :])
