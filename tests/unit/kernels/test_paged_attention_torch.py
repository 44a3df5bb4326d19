"""The batched torch attention path agrees with the reference on every batch shape the engine makes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_batches import (
    BATCHES,
    DECODE_ONLY,
    HEADS,
    MIXED,
    TOLERANCE,
    fill_unowned_slots,
    make_step,
)

from tandem.kernels import attention_torch, paged_attention_reference, paged_attention_torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("batch", BATCHES.values(), ids=BATCHES.keys())
def test_torch_path_matches_reference(batch: list[tuple[int, int]], heads: tuple[int, int], dtype: torch.dtype) -> None:
    num_heads, num_kv_heads = heads
    step = make_step(batch, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype)
    expected, _ = step.run(paged_attention_reference)
    out, _ = step.run(paged_attention_torch)
    assert out.dtype == dtype and out.shape == step.q.shape
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", BATCHES.values(), ids=BATCHES.keys())
def test_torch_path_writes_new_kv_to_their_slots_and_nothing_else(batch: list[tuple[int, int]], dtype: torch.dtype) -> None:
    step = make_step(batch, num_heads=6, num_kv_heads=2, dtype=dtype, seed=1)
    _, kv_cache = step.run(paged_attention_torch)
    # The whole cache, every layer and both K and V: only this layer's new slots changed.
    assert torch.equal(kv_cache, step.expected_cache())
    assert not torch.equal(kv_cache, step.kv_cache)


@pytest.mark.parametrize("chunk_bytes", [1, 500_000], ids=["one_seq_per_chunk", "few_seqs_per_chunk"])
@pytest.mark.parametrize("batch", [DECODE_ONLY, MIXED], ids=["decode_only", "mixed"])
def test_cpu_decode_chunks_match_reference(batch: list[tuple[int, int]], chunk_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes go through SDPA a few sequences at a time on CPU, each chunk padded to its own
    longest context; small budgets force several chunks (the default fits these batches in one)."""
    monkeypatch.setattr(attention_torch, "_CPU_DECODE_CHUNK_BYTES", chunk_bytes)
    step = make_step(batch, num_heads=9, num_kv_heads=3, head_dim=64, seed=4)
    expected, _ = step.run(paged_attention_reference)
    out, kv_cache = step.run(paged_attention_torch)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(kv_cache, step.expected_cache())


def test_torch_path_masks_whatever_lies_past_each_context() -> None:
    """Slots past a sequence's end are read (padding) but must not count: fill them with values
    that would dominate every softmax if they leaked in. (They must be finite: the torch path
    documents that it needs a cache without NaN or inf in unowned slots.)"""
    step = make_step(MIXED, num_heads=6, num_kv_heads=2, seed=2)
    expected, _ = step.run(paged_attention_reference)
    out, _ = step.run(paged_attention_torch, fill_unowned_slots(step, 1e4))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_decode_padding_bound_above_longest_context_changes_nothing() -> None:
    """meta.max_seq_len only bounds the padding: a looser bound (and wider tables) give the same answer."""
    step = make_step(DECODE_ONLY, num_heads=9, num_kv_heads=3, seed=3)
    expected, _ = step.run(paged_attention_torch)
    wider_tables = torch.nn.functional.pad(step.meta.block_tables, (0, 4))
    step.meta = dataclasses.replace(step.meta, block_tables=wider_tables, max_seq_len=step.meta.max_seq_len + 50)
    out, _ = step.run(paged_attention_torch)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_query_blocks_are_whole_aligned_blocks_of_64_below_512_and_256_from_there() -> None:
    assert attention_torch.query_blocks(0, 50) == [(0, 64)]
    assert attention_torch.query_blocks(70, 130) == [(64, 128), (128, 192)]
    assert attention_torch.query_blocks(500, 800) == [(448, 512), (512, 768), (768, 1024)]
    assert attention_torch.query_blocks(1000, 1001) == [(768, 1024)]


@pytest.mark.parametrize("seq_len", [50, 200, 700])
def test_a_prefill_row_gets_the_same_bits_however_its_prompt_is_chunked(seq_len: int) -> None:
    """bf16, 9 query heads over 3 kv heads: the prompt as one chunk, and as two chunks split at
    several points (the second one's context includes the first's, as after a cached prefix)."""
    generator = torch.Generator().manual_seed(seq_len)
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    num_blocks = -(-seq_len // block_size)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=generator)
    # the cache's blocks in table order: K and V of position p live in block table[p // 16]
    k_cache, v_cache = k_cache[torch.argsort(table)], v_cache[torch.argsort(table)]
    q = torch.randn(seq_len, num_heads, head_dim, generator=generator).to(torch.bfloat16)
    whole = attention_torch.prefill_chunk_attention(q, k_cache, v_cache, table, seq_len, 0.125)
    for split in sorted({s for s in (1, 16, 47, 64, 513, seq_len // 2, seq_len - 1) if s < seq_len}):
        head = attention_torch.prefill_chunk_attention(q[:split], k_cache, v_cache, table, split, 0.125)
        tail = attention_torch.prefill_chunk_attention(q[split:], k_cache, v_cache, table, seq_len, 0.125)
        assert torch.equal(torch.cat([head, tail]), whole), f"split at {split} of {seq_len}"
