"""Head sizes that are not powers of two (Phi-3's 96) and Gemma 2's 256 in the CPU kernels: the
attention backends agree with the reference (paged_prefill serves 96 with AVX-512 and 256 with
AVX-512 or AVX2, the torch path where it does not), and rotary_qk and rms_norm (a qk-norm over
one head) give the torch ops' bits. The triton kernels' head sizes are in
triton_interpret_check.py and triton_fused_check.py."""

from __future__ import annotations

import pytest
import torch
from paged_batches import LONG_MIXED, MIXED, TOLERANCE, make_step

from tandem.kernels import cpu_extension, paged_attention_cpu, paged_attention_reference, paged_attention_torch
from tandem.models.rotary import apply_rotary

needs_kernels = pytest.mark.skipif(not cpu_extension.load(), reason="the C++ CPU kernels do not build here (no C++ compiler?)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 45], ids=["whole", "window45"])
@pytest.mark.parametrize("attention", [paged_attention_torch, pytest.param(paged_attention_cpu, marks=needs_kernels)], ids=["torch", "cpu"])
def test_backends_match_the_reference_at_head_size_96(attention, window: int, dtype: torch.dtype) -> None:
    step = make_step(LONG_MIXED, num_heads=9, num_kv_heads=3, head_dim=96, dtype=dtype, seed=11)
    expected, expected_cache = step.run(paged_attention_reference, window=window)
    out, kv_cache = step.run(attention, window=window)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(kv_cache, expected_cache)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernels_match_the_reference_at_head_size_256_with_gemmas_soft_cap(dtype: torch.dtype) -> None:
    step = make_step(MIXED, num_heads=8, num_kv_heads=4, head_dim=256, dtype=dtype, seed=12)
    expected, _ = step.run(paged_attention_reference, window=30, softcap=50.0)
    out, _ = step.run(paged_attention_cpu, window=30, softcap=50.0)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernels
def test_paged_prefill_says_which_head_sizes_it_serves() -> None:
    served = {head_dim for head_dim in (40, 64, 96, 128, 256) if torch.ops.tandem.prefill_supported(head_dim, torch.float32)}
    assert served in ({64, 96, 128, 256}, {64, 128, 256}, set())  # AVX-512, AVX2, neither


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_qk_at_head_size_96_gives_apply_rotarys_bits(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(13)
    num_heads, num_kv_heads, head_dim, tokens = 32, 8, 96, 40
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    angles = 30 * torch.rand(tokens, 1, head_dim // 2, generator=generator)
    cos, sin = angles.cos(), angles.sin()
    q, k = torch.ops.tandem.rotary_qk(qkv, cos, sin, num_heads, num_kv_heads)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert torch.equal(q, apply_rotary(qkv[:, :q_size].reshape(tokens, num_heads, head_dim), cos, sin))
    assert torch.equal(k, apply_rotary(qkv[:, q_size : q_size + kv_size].reshape(tokens, num_kv_heads, head_dim), cos, sin))


@needs_kernels
def test_rms_norm_over_rows_of_96_gives_the_torch_norms_bits_in_bf16() -> None:
    generator = torch.Generator().manual_seed(14)
    weight = torch.randn(96, generator=generator).bfloat16()
    x = (3 * torch.randn(50, 96, generator=generator)).bfloat16()
    x32 = x.float()
    plain = weight * (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(torch.ops.tandem.rms_norm(x, weight, 1e-6), plain)  # models/layers.RMSNorm's torch path
