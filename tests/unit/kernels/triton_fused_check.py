"""The fused triton kernels (tandem.kernels.fused_triton) against the torch code they replace.

Run as a script with TRITON_INTERPRET=1 (test_fused_triton.py starts it in a subprocess), it
checks them in triton's CPU interpreter in float32 and float16 and prints one JSON line per case,
exit status 1 if any disagrees; on CUDA the test calls `cases` directly, in bfloat16 too.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from reference_model import one_prefill, random_model, tiny_config

from tandem.kernels import fused_triton
from tandem.kernels.attention_reference import paged_attention_reference, write_kv
from tandem.models.rotary import apply_rotary

# Tolerances for what may round differently (reductions' order, exp and rsqrt's last bits): a
# unit or two in the last place of the dtype. The rotation and the cache write are exact.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()  # models/layers.py's RMSNorm, its torch path
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def cases(device: str, dtype: torch.dtype) -> Iterator[dict]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    name = str(dtype).removeprefix("torch.")
    x, weight = randn(7, 96), randn(96)
    got, want = fused_triton.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5)
    yield _close(f"rms_norm_{name}", got, want, TOLERANCE[dtype])

    num_tokens, num_heads, num_kv_heads, head_dim = 5, 6, 2, 32
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    angles = torch.rand(num_tokens, 1, head_dim // 2, generator=generator).to(device) * 50.0
    cos, sin = angles.cos(), angles.sin()
    q, k = fused_triton.rotary_qk(qkv, cos, sin, num_heads, num_kv_heads)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    want_q = apply_rotary(qkv[:, :q_size].reshape(num_tokens, num_heads, head_dim), cos, sin)
    want_k = apply_rotary(qkv[:, q_size : q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim), cos, sin)
    yield _equal(f"rotary_q_{name}", q, want_q)
    yield _equal(f"rotary_k_{name}", k, want_k)

    # Phi-3's head size, 96: half of it (48) is not a power of two, the kernel pads it to 64
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * 96)
    angles = torch.rand(num_tokens, 1, 48, generator=generator).to(device) * 50.0
    cos, sin = angles.cos(), angles.sin()
    q, k = fused_triton.rotary_qk(qkv, cos, sin, num_heads, num_kv_heads)
    q_size, kv_size = num_heads * 96, num_kv_heads * 96
    yield _equal(f"rotary_q_hd96_{name}", q, apply_rotary(qkv[:, :q_size].reshape(num_tokens, num_heads, 96), cos, sin))
    yield _equal(
        f"rotary_k_hd96_{name}", k, apply_rotary(qkv[:, q_size : q_size + kv_size].reshape(num_tokens, num_kv_heads, 96), cos, sin)
    )

    gate_up = randn(4, 2 * 1100)  # two programs a row, the second partly masked
    gate, up = gate_up.chunk(2, dim=-1)
    yield _close(f"silu_and_mul_{name}", fused_triton.silu_and_mul(gate_up), F.silu(gate) * up, TOLERANCE[dtype])

    residual = randn(7, 96)
    summed = residual + x
    out = fused_triton.add_rms_norm(x, residual, weight, 1e-5)
    yield _equal(f"add_rms_norm_residual_{name}", residual, summed)
    yield _close(f"add_rms_norm_{name}", out, torch_rms_norm(summed, weight, 1e-5), TOLERANCE[dtype])

    # a layer's strided views of a block-major cache, tokens scattered over its blocks
    cache = randn(6, 3, 2, 8, num_kv_heads, head_dim)
    expected = cache.clone()
    new_k, new_v = randn(5, num_kv_heads, head_dim), randn(5, num_kv_heads, head_dim)
    slots = torch.tensor([3, 40, 17, 8, 47], device=device)
    fused_triton.write_kv(new_k, new_v, cache[:, 1, 0], cache[:, 1, 1], slots)
    write_kv(new_k, new_v, expected[:, 1, 0], expected[:, 1, 1], slots)
    yield _equal(f"write_kv_{name}", cache, expected)

    # An FP8 cache: values saturated to +-448 and rounded to e4m3. Triton's interpreter rounds to
    # e4m3 wrongly (31.66 became 16), so there the values are e4m3's own (the saturation and the
    # store checked); compiled on CUDA, randn * 100 rounds as torch rounds.
    fp8_cache = torch.zeros(6, 3, 2, 8, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn, device=device)
    fp8_expected = fp8_cache.clone()
    new_k, new_v = 100 * randn(5, num_kv_heads, head_dim), randn(5, num_kv_heads, head_dim)
    if device == "cpu":
        new_k = new_k.to(torch.float8_e4m3fn).to(dtype)
    new_k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, -500.0])
    fused_triton.write_kv(new_k, new_v.to(torch.float8_e4m3fn).to(dtype), fp8_cache[:, 1, 0], fp8_cache[:, 1, 1], slots)
    write_kv(new_k, new_v.to(torch.float8_e4m3fn).to(dtype), fp8_expected[:, 1, 0], fp8_expected[:, 1, 1], slots)
    yield _equal(f"write_kv_fp8_{name}", fp8_cache, fp8_expected)


def fused_layers_case() -> dict:
    """A tiny model's layers with the residual adds fused into the norms (LlamaModel's GPU path)
    against its plain loop, on one 20-token prefill: float32, reference attention."""
    config = tiny_config(vocab_size=128, max_position_embeddings=64)
    model = random_model(config, seed=1, attention=paged_attention_reference).model
    ids, positions, kv_cache, meta = one_prefill(config, 20)
    with torch.inference_mode():
        want = model(ids, positions, kv_cache.clone(), meta)
        h = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(positions)
        caches = kv_cache.clone()
        got = model._forward_fused(h, cos, sin, caches.select(2, 0).unbind(1), caches.select(2, 1).unbind(1), meta)
    return _close("fused_layers_float32", got, want, TOLERANCE[torch.float32])


def _close(case: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> dict:
    error = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    return {"case": case, "ok": got.dtype == want.dtype and error <= tolerance * max(1.0, scale), "max_err": error}


def _equal(case: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    return {
        "case": case,
        "ok": got.dtype == want.dtype and torch.equal(got, want),
        "max_err": (got.float() - want.float()).abs().max().item(),
    }


def main() -> int:
    results = [result for dtype in (torch.float32, torch.float16) for result in cases("cpu", dtype)]
    results.append(fused_layers_case())
    for result in results:
        print(json.dumps(result))
    return 0 if all(result["ok"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
