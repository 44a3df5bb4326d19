"""The triton paged-attention kernel agrees with the reference (in triton's CPU interpreter here,
compiled on CUDA where there is one), and its wrapper refuses what the kernel cannot take."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_batches import DECODE_ONLY, MIXED, PREFILL_ONLY, PagedStep, make_step
from triton_interpreter import interpreted_results, needs_cuda, needs_triton

from tandem.kernels import paged_attention_reference, paged_attention_triton, select_attention


@needs_triton
def test_triton_kernel_matches_reference_in_interpreter() -> None:
    cases = {result["case"] for result in interpreted_results("triton_interpret_check.py")}
    assert {"decode_gqa3_fp32", "mixed_gqa3_fp32", "mixed_gqa3_fp16", "mixed_nan_past_context_fp32"} <= cases
    assert {"mixed_gqa3_hd96_fp32", "mixed_window20_fp32", "decode_window9_softcap2_fp32", "mixed_fp8_cache_fp16"} <= cases


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [DECODE_ONLY, MIXED, PREFILL_ONLY], ids=["decode_only", "mixed", "prefill_only"])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3)], ids=["mha", "smollm2"])
def test_triton_kernel_matches_reference_on_cuda(batch: list[tuple[int, int]], heads: tuple[int, int], dtype: torch.dtype) -> None:
    num_heads, num_kv_heads = heads
    step = make_step(batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, dtype=dtype, device="cuda")
    expected, _ = _on_cpu(step).run(paged_attention_reference)
    out, kv_cache = step.run(paged_attention_triton)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(kv_cache, step.expected_cache())


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("head_dim", "cache_dtype", "window", "softcap"),
    [
        (64, None, 20, 0.0),
        (64, None, 0, 1.0),
        (96, None, 37, 2.0),
        (256, None, 0, 0.0),
        (64, torch.float8_e4m3fn, 0, 0.0),
        (96, torch.float8_e4m3fn, 25, 3.0),
    ],
    ids=["window20", "softcap1", "hd96_window37_softcap2", "hd256", "fp8", "fp8_hd96_window25_softcap3"],
)
def test_triton_kernel_serves_windows_soft_caps_head_sizes_and_fp8_caches_on_cuda(
    head_dim: int, cache_dtype: torch.dtype | None, window: int, softcap: float, dtype: torch.dtype
) -> None:
    """On the GPU the FP8 cache's writes round as torch rounds (the interpreter cannot check that)."""
    step = make_step(MIXED, num_heads=9, num_kv_heads=3, head_dim=head_dim, dtype=dtype, cache_dtype=cache_dtype, device="cuda")
    step.k[0, 0, :2] = torch.tensor([1000.0, -1000.0])  # saturated in an FP8 cache
    expected, expected_cache = _on_cpu(step).run(paged_attention_reference, window=window, softcap=softcap)
    out, kv_cache = step.run(paged_attention_triton, window=window, softcap=softcap)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(kv_cache.cpu(), expected_cache)


@needs_cuda
def test_select_attention_uses_triton_on_cuda() -> None:
    assert select_attention("cuda") is paged_attention_triton


def _on_cpu(step: PagedStep) -> PagedStep:
    tensors = {name: value for name, value in vars(step.meta).items() if isinstance(value, torch.Tensor)}
    meta = dataclasses.replace(step.meta, **{name: value.cpu() for name, value in tensors.items()})
    return PagedStep(step.q.cpu(), step.k.cpu(), step.v.cpu(), step.kv_cache.cpu(), meta, step.scale)


def _call(step: PagedStep, **replace: object) -> None:
    k_cache, v_cache = step.kv_cache[:, 1, 0], step.kv_cache[:, 1, 1]
    args = dict(q=step.q, k=step.k, v=step.v, k_cache=k_cache, v_cache=v_cache, meta=step.meta, scale=step.scale)
    paged_attention_triton(**(args | replace))


@pytest.fixture
def step() -> PagedStep:
    return make_step(MIXED, num_heads=6, num_kv_heads=2, head_dim=32)


def test_wrapper_rejects_head_dim_over_512() -> None:
    large = make_step(MIXED[:2], num_heads=2, num_kv_heads=1, head_dim=520)
    with pytest.raises(ValueError, match="head_dim must be 1 to 512, got 520"):
        _call(large)


def test_wrapper_rejects_a_negative_window(step: PagedStep) -> None:
    with pytest.raises(ValueError, match="window -1 and softcap 0.0 must be >= 0"):
        paged_attention_triton(step.q, step.k, step.v, step.kv_cache[:, 1, 0], step.kv_cache[:, 1, 1], step.meta, step.scale, window=-1)


def test_wrapper_takes_an_fp8_cache_but_no_other_cache_dtype_unlike_q(step: PagedStep) -> None:
    fp8 = step.kv_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_cache dtype torch.float8_e4m3fn != v_cache dtype torch.float32"):
        _call(step, k_cache=fp8[:, 1, 0])
    with pytest.raises(ValueError, match=r"k_cache dtype torch.float16 != q dtype torch.float32 \(nor torch.float8_e4m3fn for a cache\)"):
        _call(step, k_cache=step.kv_cache[:, 1, 0].half())


def test_wrapper_rejects_q_without_contiguous_head_dim(step: PagedStep) -> None:
    strided = step.q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, last stride != 1
    with pytest.raises(ValueError, match=r"q must have a contiguous last \(head_dim\) dimension"):
        _call(step, q=strided)


def test_wrapper_rejects_cache_without_contiguous_head_dim(step: PagedStep) -> None:
    # A cache laid out head_dim-major: the per-layer view's last stride is not 1.
    swapped = step.kv_cache.transpose(-1, -2).contiguous().transpose(-1, -2)
    with pytest.raises(ValueError, match=r"k_cache must have a contiguous last \(head_dim\) dimension"):
        _call(step, k_cache=swapped[:, 1, 0], v_cache=swapped[:, 1, 1])


def test_wrapper_rejects_mismatched_dtypes(step: PagedStep) -> None:
    with pytest.raises(ValueError, match="k_cache dtype torch.bfloat16 != q dtype torch.float32"):
        _call(step, k_cache=step.kv_cache[:, 1, 0].bfloat16())


def test_wrapper_rejects_heads_not_a_multiple_of_kv_heads(step: PagedStep) -> None:
    with pytest.raises(ValueError, match="num_heads 5 is not a multiple of num_kv_heads 2"):
        _call(step, q=step.q[:, :5])


def test_wrapper_rejects_new_kv_of_the_wrong_shape(step: PagedStep) -> None:
    with pytest.raises(ValueError, match=r"v must be \(.*\), got"):
        _call(step, v=step.v[:-1])


def test_wrapper_rejects_metadata_that_does_not_fit_the_batch(step: PagedStep) -> None:
    with pytest.raises(ValueError, match="meta.slot_mapping must be"):
        _call(step, meta=dataclasses.replace(step.meta, slot_mapping=step.meta.slot_mapping[:-1]))
    with pytest.raises(ValueError, match="meta.block_tables dtype torch.float32 is not int32 or int64"):
        _call(step, meta=dataclasses.replace(step.meta, block_tables=step.meta.block_tables.float()))
    with pytest.raises(ValueError, match="too few for max_seq_len"):
        _call(step, meta=dataclasses.replace(step.meta, block_tables=step.meta.block_tables[:, :2]))


@needs_triton
def test_wrapper_refuses_cpu_tensors_unless_interpreted(step: PagedStep) -> None:
    from tandem.kernels import paged_attention_triton_kernel

    if paged_attention_triton_kernel.is_interpreted():
        pytest.skip("this process imported triton's kernels with TRITON_INTERPRET=1")
    kv_cache = step.kv_cache.clone()
    with pytest.raises(ValueError, match="the kernel needs CUDA tensors"):
        _call(step, k_cache=kv_cache[:, 1, 0], v_cache=kv_cache[:, 1, 1])
    assert torch.equal(kv_cache, step.kv_cache), "refused, yet it wrote the cache"
