"""Sliding windows and soft-capped scores (Mistral, Gemma 2, Phi-3) in every CPU attention backend:
the reference does what Hugging Face does (a token sees its last `window` positions, scores capped
as softcap * tanh(score / softcap)), the torch path and the C++ kernels agree with it on every batch
shape, the kernels read nothing of the blocks wholly before a decode row's window, and a prefill
row gets the same bits however its prompt is chunked."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_batches import DECODE_ONLY, LAYER, LONG_DECODE, LONG_MIXED, MIXED, TOLERANCE, PagedStep, make_step

from tandem.kernels import cpu_extension, paged_attention_cpu, paged_attention_reference, paged_attention_torch

needs_kernels = pytest.mark.skipif(not cpu_extension.load(), reason="the C++ CPU kernels do not build here (no C++ compiler?)")
BACKENDS = {"torch": paged_attention_torch, "cpu": pytest.param(paged_attention_cpu, marks=needs_kernels)}
# (window, softcap): a window shorter than most contexts, a cap that bends randn scores, both.
OPTIONS = {"window20": (20, 0.0), "softcap1": (0, 1.0), "window37_softcap2": (37, 2.0)}


def test_a_window_of_one_attends_to_the_token_itself() -> None:
    step = make_step(MIXED, num_heads=6, num_kv_heads=2, seed=1)
    out, _ = step.run(paged_attention_reference, window=1)
    torch.testing.assert_close(out, step.v.repeat_interleave(3, dim=1), atol=1e-6, rtol=1e-6)


def test_a_window_as_long_as_every_context_changes_nothing_and_a_shorter_one_does() -> None:
    step = make_step(MIXED, num_heads=6, num_kv_heads=2, seed=2)
    whole, _ = step.run(paged_attention_reference)
    assert torch.equal(step.run(paged_attention_reference, window=step.meta.max_seq_len)[0], whole)
    assert not torch.allclose(step.run(paged_attention_reference, window=10)[0], whole, atol=1e-3)


def test_the_reference_window_is_hugging_faces_mask() -> None:
    """One prompt, dense: key j is visible to query i when i - window < j <= i."""
    step = make_step([(0, 40)], num_heads=2, num_kv_heads=2, seed=3)
    window = 9
    out, _ = step.run(paged_attention_reference, window=window)
    scores = torch.einsum("qhd,khd->hqk", step.q, step.k) * step.scale
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    dense = torch.einsum("hqk,khd->qhd", scores.masked_fill(~((j <= i) & (j > i - window)), float("-inf")).softmax(-1), step.v)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_a_soft_cap_bounds_the_scores() -> None:
    """A huge cap changes nothing; a tiny one flattens every score to about zero, so each token
    averages the values it sees."""
    step = make_step([(0, 30)], num_heads=2, num_kv_heads=2, seed=4)
    plain, _ = step.run(paged_attention_reference)
    torch.testing.assert_close(step.run(paged_attention_reference, softcap=1e6)[0], plain, atol=1e-5, rtol=1e-5)
    flat, _ = step.run(paged_attention_reference, softcap=1e-4)
    averages = step.v.cumsum(0) / torch.arange(1, 31)[:, None, None]
    torch.testing.assert_close(flat, averages, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("window", "softcap"), OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("batch", [MIXED, LONG_MIXED, DECODE_ONLY], ids=["mixed", "long_mixed", "decode_only"])
@pytest.mark.parametrize("attention", BACKENDS.values(), ids=BACKENDS.keys())
def test_backends_match_the_reference_with_a_window_and_a_soft_cap(
    attention, batch, window: int, softcap: float, dtype: torch.dtype
) -> None:
    step = make_step(batch, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, seed=5)
    expected, expected_cache = step.run(paged_attention_reference, window=window, softcap=softcap)
    out, kv_cache = step.run(attention, window=window, softcap=softcap)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(kv_cache, expected_cache)


def _poison_before_windows(step: PagedStep, window: int) -> torch.Tensor:
    """A copy of the step's cache whose blocks lying wholly before each sequence's window (the
    window of its first new token) hold NaN in the layer under test."""
    kv_cache = step.kv_cache.clone()
    block_size = kv_cache.shape[3]
    starts = step.meta.query_start_loc.tolist()
    for s, seq_len in enumerate(step.meta.seq_lens.tolist()):
        first_position = seq_len - (starts[s + 1] - starts[s])
        first_key = max(0, first_position + 1 - window)
        kv_cache[step.meta.block_tables[s, : first_key // block_size].long(), LAYER] = float("nan")
    return kv_cache


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [LONG_DECODE, LONG_MIXED], ids=["long_decode", "long_mixed"])
def test_the_kernels_read_nothing_of_the_blocks_before_a_window(batch: list[tuple[int, int]], dtype: torch.dtype) -> None:
    """bf16 over a bf16 cache: the prefill kernels' pairs of V rows (and on AMX their 32-key tile
    products) begin before a window that starts mid-pair: a NaN row there still adds nothing."""
    step = make_step(batch, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, seed=6)
    expected, _ = step.run(paged_attention_reference, window=50)
    poisoned = _poison_before_windows(step, 50)
    assert poisoned.isnan().any()
    out, _ = step.run(paged_attention_cpu, poisoned, window=50)
    tolerance = 2e-5 if dtype == torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@needs_kernels
@pytest.mark.parametrize("kernel", [0, 1], ids=["vector", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_windowed_prefill_row_gets_the_same_bits_however_its_prompt_is_chunked(dtype: torch.dtype, kernel: int) -> None:
    """A window (70) and a soft-cap (3): the chunks' first windows start at keys the AMX kernel's
    32-key tile products do not start at, and a row still gets the same bits."""
    if not torch.ops.tandem.prefill_supported(64, dtype):
        pytest.skip("paged_prefill does not serve this CPU")
    if kernel == 1 and not torch.ops.tandem.prefill_amx_supported(64, dtype, dtype):
        pytest.skip(f"paged_prefill's AMX kernel does not serve {dtype} here")
    step = make_step([(0, 300)], num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, seed=7)
    _, kv_cache = step.run(paged_attention_cpu)  # writes the prompt's K and V
    k_cache, v_cache, table = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], step.meta.block_tables[0]
    whole = torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 300, step.scale, 70, 3.0, kernel)
    pieces = [
        torch.ops.tandem.paged_prefill(step.q[lo:hi], k_cache, v_cache, table, hi, step.scale, 70, 3.0, kernel)
        for lo, hi in ((0, 37), (37, 200), (200, 201), (201, 300))
    ]
    assert torch.equal(torch.cat(pieces), whole)
    expected, _ = dataclasses.replace(step, kv_cache=kv_cache).run(paged_attention_reference, window=70, softcap=3.0)
    torch.testing.assert_close(whole, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernels
def test_the_kernels_refuse_a_negative_window_or_cap() -> None:
    step = make_step(DECODE_ONLY, num_heads=6, num_kv_heads=2, seed=8)
    with pytest.raises(RuntimeError, match="window and softcap must be >= 0"):
        step.run(paged_attention_cpu, window=-1)
