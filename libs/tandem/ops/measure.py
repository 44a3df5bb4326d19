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


def best_s(fn: Callable[[], object], repeats: int) -> float:
    """The shortest of `repeats` timed calls, after one untimed warm-up (first-touch pages, thread pool start)."""
    fn()
    fastest_s = float("inf")
    for _ in range(repeats):
        start_s = time.perf_counter()
        fn()
        fastest_s = min(fastest_s, time.perf_counter() - start_s)
    return fastest_s


def measure_peak_flops(dtype: torch.dtype, size: int, repeats: int) -> float:
    """FLOP/s of a large square matmul in `dtype` on all torch threads, best of `repeats`: torch's
    matmul, or the engine's packed CPU kernel where it serves the dtype (models/packed.py) and is
    the faster, so that no rate the engine reaches is above this peak."""
    from tandem.models.packed import can_pack, pack_weight  # the engine's kernel: built and loaded only when measured

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    fastest_s = best_s(lambda: torch.matmul(a, b, out=out), repeats)
    weight = b.T.contiguous()  # packed_mm multiplies by its weight's transpose
    if can_pack(weight, dtype):
        packed = pack_weight(weight, dtype)
        fastest_s = min(fastest_s, best_s(lambda: torch.ops.tandem.packed_mm(a, packed, None), repeats))
    return 2 * size**3 / fastest_s


def measure_copy_bandwidth(num_mib: int, repeats: int) -> float:
    """Bytes/s of copying a `num_mib` tensor (bytes read + bytes written), best of `repeats`."""
    src = torch.ones(num_mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_s(lambda: dst.copy_(src), repeats)


def physical_memory_bytes() -> int:
    """This machine's RAM, all of it (the worksheet's runtime reserve stands for what else uses it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
