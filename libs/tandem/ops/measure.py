"""This machine's peaks, measured with torch (and the engine's CPU matmul): copy bandwidth and
matmul FLOP/s.

`tandem plan --gpu cpu` sizes against them, and bench/roofline.py bounds the engine with them, so
the worksheet's decode floor and the bench's measured time per output token share one yardstick.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch


def best_s(fn: Callable[[], object], repeats: int, device: str = "cpu") -> float:
    """The shortest of `repeats` timed calls, after one untimed warm-up (first-touch pages, thread
    pool start); on a GPU each call's timing waits for its kernels."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()
    sync()
    fastest_s = float("inf")
    for _ in range(repeats):
        start_s = time.perf_counter()
        fn()
        sync()
        fastest_s = min(fastest_s, time.perf_counter() - start_s)
    return fastest_s


def measure_matmul_flops(dtype: torch.dtype, size: int, repeats: int, device: str = "cpu") -> dict[str, float]:
    """FLOP/s of a large square matmul in `dtype` on `device` (all torch threads on a CPU), best of
    `repeats`, by kernel: torch's ("torch", the faster of a @ b and linear(a, b.T)), and on a CPU
    the engine's packed kernels where they serve the dtype (models/packed.py: "packed", the dot
    products', and "amx", AMX tiles')."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device, dtype)
    b = torch.randn(size, size, generator=generator).to(device, dtype)
    out = torch.empty(size, size, dtype=dtype, device=device)
    flops = 2 * size**3
    # torch's own, the faster of its two layouts: b as stored, and b as a Linear's weight (its
    # transpose; oneDNN took that about a fifth faster on the AMX Xeon, 1,860 GFLOP/s against 1,530)
    weight = b.T.contiguous()
    rates = {
        "torch": flops
        / min(
            best_s(lambda: torch.matmul(a, b, out=out), repeats, device),
            best_s(lambda: torch.nn.functional.linear(a, weight), repeats, device),
        )
    }
    if torch.device(device).type == "cpu":
        from tandem.models.packed import can_pack, pack_weight  # the engine's kernel: built and loaded only when measured

        if can_pack(weight, dtype):  # packed_mm multiplies by its weight's transpose, as linear does
            packed = pack_weight(weight, dtype)
            rates["packed"] = flops / best_s(lambda: torch.ops.tandem.packed_mm(a, packed, None), repeats)
            if torch.ops.tandem.packed_mm_amx_supported(size, dtype):  # its AMX kernel (kernels/gemm_choice.py)
                rates["amx"] = flops / best_s(lambda: torch.ops.tandem.packed_mm(a, packed, None, 1), repeats)
    return rates


def measure_peak_flops(dtype: torch.dtype, size: int, repeats: int, device: str = "cpu") -> float:
    """The fastest of measure_matmul_flops' kernels: no rate the engine reaches is above this peak."""
    return max(measure_matmul_flops(dtype, size, repeats, device).values())


def measure_copy_bandwidth(num_mib: int, repeats: int, device: str = "cpu") -> float:
    """Bytes/s of copying a `num_mib` tensor on `device` (bytes read + bytes written), best of `repeats`."""
    src = torch.ones(num_mib * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_s(lambda: dst.copy_(src), repeats, device)


def physical_memory_bytes() -> int:
    """This machine's RAM, all of it (the worksheet's runtime reserve stands for what else uses it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
