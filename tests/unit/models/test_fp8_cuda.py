"""FP8 weights on a GPU with fp8 tensor cores (compute capability 8.9 or more): Fp8Linear takes
torch._scaled_mm, each row of activations quantized to e4m3 with its own scale, and stays close to
the dequantized weight's product (bench/gpu_check.sh runs it; skipped without such a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.models.fp8 import SCALED_MM_CAPABILITY, Fp8Linear, scaled_mm_serves

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < SCALED_MM_CAPABILITY,
    reason="needs a CUDA GPU of compute capability 8.9 or more",
)


@pytest.mark.parametrize("num_rows", [1, 7, 300], ids=lambda n: f"{n}-rows")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_scaled_mm_is_taken_and_stays_near_the_dequantized_product(num_rows, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(512, 256, bias=True).to(device="cuda", dtype=dtype)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(num_rows, 512, device="cuda", dtype=dtype)
    assert scaled_mm_serves(x, layer.out_features)
    out = layer(x)
    expected = x.float() @ layer.dequantized_weight(torch.float32).T + layer.bias.float()
    assert out.dtype == dtype and out.shape == (num_rows, 256)
    # the activations' own e4m3 rounding: about 2^-4 of each product, averaging out over 512 terms
    error = (out.float() - expected).abs().amax() / expected.abs().amax()
    assert error < 0.03, f"relative error {error:.4f}"
