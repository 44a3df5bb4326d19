"""The fused triton kernels (RMSNorm, rotation, SiLU-and-mul, KV write) give what the torch code
they replace gives: in triton's CPU interpreter here, compiled on CUDA where there is one."""

from __future__ import annotations

import pytest
import torch
from triton_fused_check import cases
from triton_interpreter import interpreted_results, needs_cuda, needs_triton

from tandem.kernels import fused_triton


@needs_triton
def test_fused_kernels_match_torch_in_the_interpreter() -> None:
    results = interpreted_results("triton_fused_check.py")
    assert len(results) == 21 and results[-1]["case"] == "fused_layers_float32"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_kernels_match_torch_on_cuda(dtype: torch.dtype) -> None:
    results = list(cases("cuda", dtype))
    assert len(results) == 10 and all(result["ok"] for result in results), results


def test_the_models_call_them_on_cuda_tensors_only() -> None:
    assert not fused_triton.serves(torch.zeros(2, 2))


def test_wrappers_refuse_shapes_the_kernels_cannot_take() -> None:
    with pytest.raises(ValueError, match="rms_norm"):
        fused_triton.rms_norm(torch.zeros(2, 8).t(), torch.ones(2), 1e-5)
    with pytest.raises(ValueError, match="rotary_qk: qkv"):
        fused_triton.rotary_qk(torch.zeros(3, 100), torch.zeros(3, 1, 8), torch.zeros(3, 1, 8), 4, 2)
    with pytest.raises(ValueError, match="rotary_qk: cos"):
        fused_triton.rotary_qk(torch.zeros(3, 128), torch.zeros(3, 8), torch.zeros(3, 1, 8), 4, 2)
    with pytest.raises(ValueError, match="silu_and_mul"):
        fused_triton.silu_and_mul(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="write_kv: k_cache"):
        k = torch.zeros(2, 2, 16)
        fused_triton.write_kv(k, k, torch.zeros(4, 8, 3, 16), torch.zeros(4, 8, 2, 16), torch.zeros(2, dtype=torch.long))
