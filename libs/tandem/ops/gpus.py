"""The accelerators `tandem plan` knows: memory, bandwidth, dense FLOP/s, board power, a price.

Figures are the vendors' datasheet numbers for one SXM/PCIe board (decimal units: 1 GB = 1e9 B,
1 TB/s = 1e12 B/s; FLOP/s dense, without the 2:4-sparsity doubling the datasheets headline).
Prices are round indicative on-demand cloud figures; pass --gpu-hour-price with yours.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tandem.errors import StartupError

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float
    bf16_flops: float  # dense bf16/fp16 tensor FLOP/s (custom and cpu: the rate in the worksheet's dtype)
    fp8_flops: float | None  # dense fp8 tensor FLOP/s; None: no fp8 tensor cores, fp8 weights compute at bf16's rate
    board_power_w: float | None  # None: unknown (the cpu entry), so power needs --kw-per-server
    hour_price: float | None  # $/GPU-hour; None: unknown, so cost needs --gpu-hour-price
    source: str  # where the figures come from, printed under the worksheet

    def flops_for(self, dtype: str) -> float:
        """Dense FLOP/s for weights in `dtype`: fp8 at the fp8 rate where the GPU has one."""
        return self.fp8_flops if dtype == "fp8" and self.fp8_flops is not None else self.bf16_flops


GPUS: dict[str, Gpu] = {
    "h100": Gpu("H100 SXM 80 GB", 80 * GB, 3350 * GB, 989 * TFLOPS, 1979 * TFLOPS, 700, 3.00, "NVIDIA H100 datasheet"),
    "h200": Gpu("H200 SXM 141 GB", 141 * GB, 4800 * GB, 989 * TFLOPS, 1979 * TFLOPS, 700, 3.50, "NVIDIA H200 datasheet"),
    "a100": Gpu("A100 SXM 80 GB", 80 * GB, 2039 * GB, 312 * TFLOPS, None, 400, 1.50, "NVIDIA A100 datasheet"),
    "b200": Gpu("B200 180 GB", 180 * GB, 7700 * GB, 2250 * TFLOPS, 4500 * TFLOPS, 1000, 5.00, "NVIDIA HGX B200 datasheet, per GPU"),
    "l40s": Gpu("L40S 48 GB", 48 * GB, 864 * GB, 362 * TFLOPS, 733 * TFLOPS, 350, 1.00, "NVIDIA L40S datasheet"),
}
MEASURED_ENTRIES = ("cpu",)  # this machine, its figures measured (--measure-bandwidth, --measure-flops) or given
CUSTOM_ENTRY = "custom"  # every figure from --gpu-* flags
GPU_CHOICES = (*GPUS, *MEASURED_ENTRIES, CUSTOM_ENTRY)


@dataclass(frozen=True)
class GpuOverrides:
    """Figures given on the command line (or measured here), each replacing the table's."""

    memory_bytes: float | None = None
    bandwidth_bytes_per_s: float | None = None
    flops: float | None = None  # in the worksheet's dtype
    board_power_w: float | None = None


def resolve_gpu(name: str, overrides: GpuOverrides, cpu_memory_bytes: float | None = None) -> Gpu:
    """The table's entry with `overrides` applied; "custom" and "cpu" are built from them alone
    (the cpu's memory defaults to this machine's RAM). A figure that is missing is a StartupError
    naming the flag that gives it."""
    key = name.lower()
    if key in GPUS:
        base = GPUS[key]
        gpu = dataclasses.replace(
            base,
            memory_bytes=overrides.memory_bytes or base.memory_bytes,
            bandwidth_bytes_per_s=overrides.bandwidth_bytes_per_s or base.bandwidth_bytes_per_s,
            board_power_w=_given(overrides.board_power_w, base.board_power_w),
        )
        if overrides.flops is not None:
            gpu = dataclasses.replace(gpu, bf16_flops=overrides.flops, fp8_flops=overrides.flops)
        return gpu if gpu == base else dataclasses.replace(gpu, source=f"{base.source}, with figures from flags")
    if key not in (*MEASURED_ENTRIES, CUSTOM_ENTRY):
        raise StartupError(f"--gpu {name!r} is not known (known: {', '.join(GPU_CHOICES)})")
    memory_bytes = overrides.memory_bytes if overrides.memory_bytes is not None else (cpu_memory_bytes if key == "cpu" else None)
    missing = [
        flag
        for flag, value in (
            ("--gpu-memory-gb", memory_bytes),
            ("--gpu-bandwidth-gbs" + (" or --measure-bandwidth" if key == "cpu" else ""), overrides.bandwidth_bytes_per_s),
            ("--gpu-tflops" + (" or --measure-flops" if key == "cpu" else ""), overrides.flops),
        )
        if value is None
    ]
    if missing or memory_bytes is None or overrides.bandwidth_bytes_per_s is None or overrides.flops is None:
        raise StartupError(f"--gpu {key} needs {', '.join(missing)}")
    return Gpu(
        name="this machine's CPU" if key == "cpu" else "custom",
        memory_bytes=memory_bytes,
        bandwidth_bytes_per_s=overrides.bandwidth_bytes_per_s,
        bf16_flops=overrides.flops,
        fp8_flops=overrides.flops,
        board_power_w=overrides.board_power_w,
        hour_price=None,
        source="measured here or given by flags" if key == "cpu" else "given by flags",
    )


def _given(override: float | None, default: float | None) -> float | None:
    return default if override is None else override
