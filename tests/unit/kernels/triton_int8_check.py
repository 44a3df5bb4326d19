"""The int8 triton kernel (tandem.kernels.int8_triton) against the float64 product.

Run as a script with TRITON_INTERPRET=1 (test_int8_triton.py starts it in a subprocess), it
checks the kernel in triton's CPU interpreter in float32 and float16 and prints one JSON line per
case, exit status 1 if any fails; on CUDA the test calls `cases` directly, in bfloat16 too.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import numpy as np
import torch

from tandem.kernels import int8_triton

# One float32 sum per output, rounded once to the dtype: within a unit or two in its last place.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def numpy_gives_rows_their_own_bits() -> bool:
    """Whether this host's numpy matmul (the interpreter's tl.dot) gives a tile's row the same bits
    alone, among zero rows, as among other rows. Not everywhere: OpenBLAS takes a tile's rows in
    groups and the rest through another kernel (on an AMD EPYC Zen 5, rows 6-11 of a 16-row tile
    came out an ulp apart), and there the interpreter cannot show the kernel's own row bits."""
    rng = np.random.default_rng(0)
    a, b = rng.random((16, 128), dtype=np.float32), rng.random((128, 16), dtype=np.float32)
    together = a @ b
    for i in range(16):
        alone = np.zeros_like(a)
        alone[0] = a[i]
        if not np.array_equal((alone @ b)[0], together[i]):
            return False
    return True


def cases(device: str, dtype: torch.dtype) -> Iterator[dict]:
    generator = torch.Generator().manual_seed(0)
    name = str(dtype).removeprefix("torch.")
    # 88 channels: full programs and a masked one; 200 inputs: a masked last slice; 40 rows: two
    # full row tiles and a masked one.
    weight = torch.randint(-127, 128, (88, 200), generator=generator, dtype=torch.int8).to(device)
    scale = (torch.rand(88, generator=generator) / 100 + 1e-3).to(device, dtype)
    x = torch.randn(40, 200, generator=generator).to(device, dtype)
    out = int8_triton.int8_mm(x, weight, scale)
    want = x.double() @ (weight.double() * scale.double()[:, None]).T
    error = (out.double() - want).abs().max().item()
    yield {
        "case": f"product_{name}",
        "ok": out.dtype == dtype and out.shape == (40, 88) and error <= TOLERANCE[dtype] * want.abs().max().item(),
        "max_err": error,
    }

    alone = torch.cat([int8_triton.int8_mm(x[i : i + 1], weight, scale) for i in range(x.shape[0])])
    first7 = int8_triton.int8_mm(x[:7], weight, scale)
    if device != "cpu" or numpy_gives_rows_their_own_bits():
        same = torch.equal(out, alone) and torch.equal(first7, alone[:7])
    else:  # the interpreter on such a host: each row within the product's rounding of the others
        bound = TOLERANCE[dtype] * want.abs().max().item()
        same = (out - alone).abs().max().item() <= bound and (first7 - alone[:7]).abs().max().item() <= bound
    yield {"case": f"rows_own_bits_{name}", "ok": same}

    wide = torch.cat([x, x], dim=1)[:, :200]  # rows 400 elements apart
    yield {"case": f"strided_rows_{name}", "ok": torch.equal(int8_triton.int8_mm(wide, weight, scale), out)}

    empty = int8_triton.int8_mm(x[:0], weight, scale)
    yield {"case": f"no_rows_{name}", "ok": empty.shape == (0, 88) and empty.dtype == dtype}


def main() -> int:
    results = [result for dtype in (torch.float32, torch.float16) for result in cases("cpu", dtype)]
    for result in results:
        print(json.dumps(result))
    return 0 if all(result["ok"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
