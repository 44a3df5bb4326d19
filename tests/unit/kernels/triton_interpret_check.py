"""Runs the triton paged-attention kernel in triton's CPU interpreter against the reference.

Started by test_paged_attention_triton.py in a subprocess whose environment has
TRITON_INTERPRET=1, so the interpreter never leaks into other tests (@triton.jit picks
interpreted or compiled once, at decoration). Prints one JSON line per case; exit status 1 if
any case disagrees with the reference or its cache writes.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from paged_batches import DECODE_ONLY, MIXED, PagedStep, fill_unowned_slots, make_step

from tandem.kernels import paged_attention_reference, paged_attention_triton

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2}
# Small shapes: the interpreter runs every program in numpy. No bfloat16: the interpreter keeps
# it as uint16 and tl.dot multiplies the bit patterns (triton-lang/triton#11584, "not supported
# yet"); float16 stands in for the half-precision path here, bfloat16 is checked on CUDA.
# name: (batch, num_heads, num_kv_heads, head_dim, block_size, dtype)
CASES = {
    "decode_mha_fp32": (DECODE_ONLY[:5], 2, 2, 16, 16, torch.float32),
    "decode_gqa3_fp32": (DECODE_ONLY[:5], 6, 2, 16, 16, torch.float32),
    "mixed_gqa3_fp32": (MIXED, 6, 2, 16, 16, torch.float32),
    "mixed_mha_fp32": (MIXED[:6], 2, 2, 32, 16, torch.float32),
    "mixed_gqa3_fp16": (MIXED[:6], 3, 1, 16, 16, torch.float16),
    "mixed_gqa3_block8_fp32": (MIXED[:6], 6, 2, 16, 8, torch.float32),
    "mixed_gqa3_hd24_fp32": (MIXED[:6], 3, 1, 24, 16, torch.float32),  # head sizes padded to a power of two
    "mixed_gqa3_hd96_fp32": (MIXED[:4], 3, 1, 96, 16, torch.float32),
}
# name: (batch, num_heads, num_kv_heads, dtype, window, softcap)
WINDOW_CASES = {
    "mixed_window20_fp32": (MIXED[:6], 6, 2, torch.float32, 20, 0.0),
    "mixed_softcap1_fp32": (MIXED[:6], 6, 2, torch.float32, 0, 1.0),
    "decode_window9_softcap2_fp32": (DECODE_ONLY[:5], 6, 2, torch.float32, 9, 2.0),
    "mixed_window7_fp16": (MIXED[:6], 3, 1, torch.float16, 7, 0.0),
}


def work_around_triton_9171() -> None:
    """triton 3.6's interpreter turns a loop bound into an int with int(size-1 array), which
    numpy >= 2.4 refuses (triton-lang/triton#9171; fixed upstream by #9172, not in the 3.6.0 installed here).
    Apply the upstream fix in this process; a no-op where numpy still converts."""
    try:
        int(np.zeros(1))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patched(tensor: type, scope: object) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def check(name: str, step: PagedStep, dtype: torch.dtype, garbage: float | None = None, **options: float) -> dict:
    expected, _ = step.run(paged_attention_reference, **options)
    cache = None if garbage is None else fill_unowned_slots(step, garbage)
    out, kv_cache = step.run(paged_attention_triton, cache, **options)
    error = (out.float() - expected.float()).abs().max().item()
    is_close = torch.allclose(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    is_written = garbage is not None or torch.equal(kv_cache, step.expected_cache())
    return {"case": name, "max_abs_error": error, "ok": bool(is_close and is_written and out.dtype == dtype)}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    work_around_triton_9171()
    results = []
    for name, (batch, num_heads, num_kv_heads, head_dim, block_size, dtype) in CASES.items():
        shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
        step = make_step(batch, **shape, dtype=dtype, seed=len(results))
        results.append(check(name, step, dtype))
    for name, (batch, num_heads, num_kv_heads, dtype, window, softcap) in WINDOW_CASES.items():
        step = make_step(batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, dtype=dtype, seed=len(results))
        results.append(check(name, step, dtype, window=window, softcap=softcap))
    # An FP8 cache, widened to q's dtype as it is read. The new k and v are e4m3 values already:
    # the interpreter rounds to e4m3 wrongly (the CUDA test checks the rounding).
    for dtype, name in ((torch.float32, "fp32"), (torch.float16, "fp16")):
        step = make_step(MIXED[:6], num_heads=6, num_kv_heads=2, head_dim=16, dtype=dtype, cache_dtype=torch.float8_e4m3fn, seed=50)
        step.k, step.v = step.k.to(torch.float8_e4m3fn).to(dtype), step.v.to(torch.float8_e4m3fn).to(dtype)
        results.append(check(f"mixed_fp8_cache_{name}", step, dtype, window=11))
    step = make_step(MIXED[:6], num_heads=6, num_kv_heads=2, head_dim=16, seed=99)
    results.append(check("mixed_nan_past_context_fp32", step, torch.float32, garbage=float("nan")))
    # q as the model makes it: a strided view into the fused qkv projection's output.
    step = make_step(MIXED[:6], num_heads=6, num_kv_heads=2, head_dim=16, seed=7)
    fused = torch.randn(step.q.shape[0], 10 * 16)
    fused[:, : 6 * 16] = step.q.reshape(-1, 6 * 16)
    step.q = fused[:, : 6 * 16].view(-1, 6, 16)
    results.append(check("mixed_strided_q_fp32", step, torch.float32))
    for result in results:
        print(json.dumps(result))
    return 0 if all(result["ok"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
