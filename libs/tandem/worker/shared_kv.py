"""The KV cache that a worker and its engine process share: a memfd the worker creates
(`create_kv_memfd`) and passes to the engine process, which sizes it and allocates its engine's
cache in it (`shared_kv_cache`); once the engine is built the worker maps it too (`map_kv_cache`),
so a handoff's blocks are read and written without a copy through the socket."""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch

from tandem.engine.engine import KvCacheAllocator


def create_kv_memfd() -> int:
    """An empty memfd for the KV cache, on the worker's side; the engine process sizes it."""
    return os.memfd_create("tandem-kv-cache")


def shared_kv_cache(fd: int) -> KvCacheAllocator:
    """An allocator (Engine's allocate_kv_cache) of a zeroed CPU KV cache in the memfd `fd`."""

    def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            raise ValueError(f"an engine process shares its KV cache on a CPU only, not on {device}")
        num_bytes = math.prod(shape) * dtype.itemsize
        # A memfd takes any size and faults pages in as they are touched; refuse what torch.zeros's
        # allocation would (more than the memory and swap there are) now, not at a later step.
        if num_bytes > (limit := _memory_bytes()):
            raise MemoryError(
                f"a KV cache of {num_bytes / 2**30:.1f} GiB does not fit in this machine's {limit / 2**30:.1f} GiB of memory and swap"
            )
        os.ftruncate(fd, num_bytes)  # a memfd grows zero-filled
        return map_kv_cache(fd, shape, dtype)

    return allocate


def map_kv_cache(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The memfd `fd` (sized already) as a KV cache tensor, every page mapped now (MAP_POPULATE):
    the first mapping allocates the cache's memory at start, as a GPU engine does, and the other
    process's maps what is there. Faulted in page by page instead, a handoff's blocks cost the
    worker and its engine process a page fault per page touched on the way to the reply's second
    token, which made that token far slower than with one process."""
    numel = math.prod(shape)
    buffer = mmap.mmap(fd, numel * dtype.itemsize, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # the tensor keeps the mapping


def _memory_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    return sum(int(fields.get(name, "0 kB").split()[0]) * 1024 for name in ("MemTotal", "SwapTotal"))
