"""The machine's matmul rates by kernel (ops/measure.py): torch's own, and the engine's packed
kernels where they serve; the peak is the fastest of them."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu_extension
from tandem.ops import measure
from tandem.ops.measure import measure_matmul_flops


def test_torch_matmul_is_always_measured_and_the_packed_kernels_where_they_serve() -> None:
    rates = measure_matmul_flops(torch.float32, 256, 1)
    assert rates["torch"] > 0
    if cpu_extension.load() and torch.ops.tandem.packed_mm_supported(256, 256, torch.float32, torch.float32):
        assert rates["packed"] > 0
    assert "amx" not in rates  # AMX tiles take bf16 rows only


def test_the_peak_is_the_fastest_kernel_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "measure_matmul_flops", lambda *args: {"torch": 1.7e12, "packed": 0.2e12, "amx": 2.1e12})
    assert measure.measure_peak_flops(torch.bfloat16, 2048, 3) == 2.1e12
