"""The fused triton kernels (RMSNorm, rotation, SiLU-and-mul, KV write) give what the torch code
they replace gives: in triton's CPU interpreter here, compiled on CUDA where there is one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_fused_check import cases

from tandem.kernels import fused_triton, is_triton_available

HERE = Path(__file__).resolve().parent
needs_triton = pytest.mark.skipif(not is_triton_available(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not is_triton_available(), reason="needs a CUDA GPU and triton")


@needs_triton
def test_fused_kernels_match_torch_in_the_interpreter() -> None:
    # A subprocess: @triton.jit picks interpreted or compiled when the kernel module is imported.
    tests = str(HERE.parent.parent)  # reference_model's folder
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, str(HERE / "triton_fused_check.py")], cwd=HERE, env=env, capture_output=True, text=True, timeout=300
    )
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert results, f"no results (exit {run.returncode}):\n{run.stderr[-4000:]}"
    failed = [result for result in results if not result["ok"]]
    assert not failed and run.returncode == 0, f"{failed}\n{run.stderr[-4000:]}"
    assert len(results) == 15 and results[-1]["case"] == "fused_layers_float32"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_kernels_match_torch_on_cuda(dtype: torch.dtype) -> None:
    results = list(cases("cuda", dtype))
    assert len(results) == 7 and all(result["ok"] for result in results), results


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
