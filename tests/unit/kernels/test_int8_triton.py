"""The int8 triton kernel gives the float64 product within the dtype's rounding, each row its own
bits: in triton's CPU interpreter here, compiled on CUDA where there is one. Int8Linear takes it
for CUDA rows only."""

from __future__ import annotations

import pytest
import torch
from triton_int8_check import cases
from triton_interpreter import interpreted_results, needs_cuda, needs_triton

from tandem.kernels import int8_triton
from tandem.models.quant import Int8Linear


@needs_triton
def test_int8_kernel_matches_the_product_in_the_interpreter() -> None:
    results = interpreted_results("triton_int8_check.py")
    assert len(results) == 8 and results[-1]["case"] == "no_rows_float16"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_kernel_matches_the_product_on_cuda(dtype: torch.dtype) -> None:
    results = list(cases("cuda", dtype))
    assert len(results) == 4 and all(result["ok"] for result in results), results


@needs_cuda
def test_int8_linear_takes_the_kernel_up_to_its_row_bound_on_cuda() -> None:
    generator = torch.Generator().manual_seed(3)
    layer = Int8Linear.from_linear(torch.nn.Linear(192, 64, bias=False).to(torch.bfloat16)).to("cuda")
    x = torch.randn(int8_triton.MAX_ROWS + 1, 192, generator=generator).to("cuda", torch.bfloat16)
    kernel = int8_triton.int8_mm(x[:5], layer.weight_int8, layer.scale)
    assert torch.equal(layer(x[:5]), kernel)
    cast = torch.nn.functional.linear(x, layer.weight_int8.to(torch.bfloat16)) * layer.scale
    assert torch.equal(layer(x), cast), "above MAX_ROWS: the cast weight"


def test_the_layers_take_it_for_cuda_rows_only() -> None:
    assert not int8_triton.serves(torch.zeros(2, 64))


def test_wrapper_refuses_what_the_kernel_cannot_take() -> None:
    weight, scale = torch.zeros(32, 64, dtype=torch.int8), torch.ones(32)
    with pytest.raises(ValueError, match="int8_mm: x"):
        int8_triton.int8_mm(torch.zeros(64, 3).t(), weight, scale)  # not unit-stride rows
    with pytest.raises(ValueError, match="int8_mm: weight"):
        int8_triton.int8_mm(torch.zeros(3, 64), weight.float(), scale)
    with pytest.raises(ValueError, match="int8_mm: weight"):
        int8_triton.int8_mm(torch.zeros(3, 48), weight, scale)  # inputs do not match
    with pytest.raises(ValueError, match="int8_mm: scale"):
        int8_triton.int8_mm(torch.zeros(3, 64), weight, scale.half())
