"""The C++ CPU kernels (kernels/cpu/): paged decode attention agrees with the reference on every
batch shape the engine makes and gives a decode row the same bits in any company; the KV write
touches exactly the new slots; the fused RMSNorm and rotation give the torch ops' bits."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F
from paged_batches import (
    BATCHES,
    DECODE_ONLY,
    HEADS,
    LAYER,
    LONG_DECODE,
    LONG_MIXED,
    MIXED,
    PREFILL_ONLY,
    TOLERANCE,
    fill_unowned_slots,
    make_step,
)

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import cpu_extension, paged_attention_cpu, paged_attention_reference, select_attention
from tandem.models.layers import GatedMLP, RMSNorm
from tandem.models.loader import load_model
from tandem.models.quant import Int8Linear
from tandem.models.rotary import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_extension.load(), reason="the C++ CPU kernels do not build here (no C++ compiler?)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("batch", BATCHES.values(), ids=BATCHES.keys())
def test_cpu_kernels_match_reference(batch: list[tuple[int, int]], heads: tuple[int, int], dtype: torch.dtype) -> None:
    num_heads, num_kv_heads = heads
    step = make_step(batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, dtype=dtype)
    expected, expected_cache = step.run(paged_attention_reference)
    out, kv_cache = step.run(paged_attention_cpu)
    assert out.dtype == dtype and out.shape == step.q.shape
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(kv_cache, expected_cache)


# The vectorised path serves head sizes that are a multiple of 16 (64, 128) in fp32, bf16 and
# fp16 with AVX-512, a multiple of 64 with AVX2 alone; any other size takes the plain loops.
@pytest.mark.parametrize(
    ("head_dim", "dtype", "tolerance"),
    [
        (128, torch.bfloat16, 3e-2),
        (64, torch.float16, 5e-3),
        (128, torch.float16, 5e-3),
        (32, torch.float32, 2e-5),
        (40, torch.bfloat16, 3e-2),
    ],
    ids=["hd128-bf16", "hd64-fp16", "hd128-fp16", "hd32-fp32", "hd40-bf16"],
)
def test_cpu_kernels_match_reference_at_every_head_size_and_dtype(head_dim: int, dtype: torch.dtype, tolerance: float) -> None:
    step = make_step(LONG_MIXED, num_heads=9, num_kv_heads=3, head_dim=head_dim, dtype=dtype)
    expected, expected_cache = step.run(paged_attention_reference)
    out, kv_cache = step.run(paged_attention_cpu)
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(kv_cache, expected_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_writes_the_new_slots_of_this_layer_and_nothing_else(dtype: torch.dtype) -> None:
    step = make_step(MIXED, num_heads=6, num_kv_heads=2, dtype=dtype, seed=1)
    kv_cache = step.kv_cache.clone()
    # k and v as the model hands them over: views of one projection's output, rows strided
    fused = torch.cat([step.k, step.v], dim=-1)
    k, v = fused.split(step.k.shape[-1], dim=-1)
    torch.ops.tandem.write_kv(k, v, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], step.meta.slot_mapping)
    assert torch.equal(kv_cache, step.expected_cache())


def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing() -> None:
    step = make_step(DECODE_ONLY, num_heads=6, num_kv_heads=2, seed=2)
    kv_cache = step.kv_cache.clone()
    slots = step.meta.slot_mapping.clone()
    slots[-1] = kv_cache.shape[0] * kv_cache.shape[3]
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.tandem.write_kv(step.k, step.v, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], slots)
    assert torch.equal(kv_cache, step.kv_cache)


def test_decode_and_prefill_read_nothing_past_each_context() -> None:
    """Unowned slots hold NaN: the torch path would need them finite; these kernels never read
    them, for decode rows and prefill chunks alike."""
    step = make_step(MIXED, num_heads=9, num_kv_heads=3, head_dim=64, seed=3)
    expected, _ = step.run(paged_attention_reference)
    out, _ = step.run(paged_attention_cpu, fill_unowned_slots(step, float("nan")))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


# paged_prefill's kernels (its `kernel` argument): the vector units', and AMX tiles' for bf16
# queries over a bf16 cache where the CPU has them.
PREFILL_KERNELS = {"vector": 0, "amx": 1}


def skip_unless_prefill_serves(kernel: int, head_dim: int, dtype: torch.dtype) -> None:
    if not torch.ops.tandem.prefill_supported(head_dim, dtype):
        pytest.skip("paged_prefill needs AVX-512 (attention_cpu takes torch's path without it)")
    if kernel == PREFILL_KERNELS["amx"] and not torch.ops.tandem.prefill_amx_supported(head_dim, dtype, dtype):
        pytest.skip(f"paged_prefill's AMX kernel does not serve {dtype} here (AMX bf16 tiles, bf16 queries and cache)")


@pytest.mark.parametrize("kernel", PREFILL_KERNELS.values(), ids=PREFILL_KERNELS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 96)], ids=["smollm2", "hd128", "hd96-mha"]
)
def test_a_prefill_row_gets_the_same_bits_however_its_prompt_is_chunked(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kernel: int
) -> None:
    """A 300-token prompt whose K and V are cached: its rows computed in one chunk, and in chunks
    that cut across the kernel's 16-row tiles, 16-token blocks and the AMX kernel's 32-key tile
    products, have the same bits, close to the reference."""
    skip_unless_prefill_serves(kernel, head_dim, dtype)
    step = make_step([(0, 300)], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=5)
    _, kv_cache = step.run(paged_attention_cpu)  # writes the prompt's K and V
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    table = step.meta.block_tables[0]
    whole = torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 300, step.scale, kernel=kernel)
    pieces = [
        torch.ops.tandem.paged_prefill(step.q[lo:hi], k_cache, v_cache, table, hi, step.scale, kernel=kernel)
        for lo, hi in ((0, 37), (37, 200), (200, 201), (201, 300))
    ]
    assert torch.equal(torch.cat(pieces), whole)
    expected, _ = step.run(paged_attention_reference)
    torch.testing.assert_close(whole, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_paged_prefill_serves_bf16_on_amx_tiles_by_default_where_it_can() -> None:
    """The default kernel is the AMX one where it serves (bf16 queries and cache) and the vector
    one elsewhere; asking for AMX where it does not serve is an error that says so."""
    if not torch.ops.tandem.prefill_supported(64, torch.bfloat16):
        pytest.skip("paged_prefill needs AVX-512")
    step = make_step([(0, 100)], num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, seed=2)
    _, kv_cache = step.run(paged_attention_cpu)
    k_cache, v_cache, table = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], step.meta.block_tables[0]
    default = torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 100, step.scale)
    amx = torch.ops.tandem.prefill_amx_supported(64, torch.bfloat16, torch.bfloat16)
    chosen = torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 100, step.scale, kernel=1 if amx else 0)
    assert torch.equal(default, chosen)
    assert not torch.ops.tandem.prefill_amx_supported(64, torch.float32, torch.bfloat16)
    with pytest.raises(RuntimeError, match="AMX kernel does not serve"):
        torch.ops.tandem.paged_prefill(step.q.float(), k_cache, v_cache, table, 100, step.scale, kernel=1)
    with pytest.raises(RuntimeError, match="kernel must be"):
        torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 100, step.scale, kernel=2)
    # a scale <= 0 (no model has one) takes the vector units, whose softmax shifts by the scaled maximum
    negative = torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 100, -step.scale)
    assert torch.equal(negative, torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 100, -step.scale, kernel=0))
    if amx:
        with pytest.raises(RuntimeError, match="scale > 0"):
            torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 100, -step.scale, kernel=1)


def test_paged_prefill_serves_blocks_of_any_size_on_amx_tiles() -> None:
    """The AMX kernel copies each head's keys into rows of their own, so 8-token blocks (half a
    tile) take it by default too, close to the vector kernel's answer."""
    if not torch.ops.tandem.prefill_amx_supported(64, torch.bfloat16, torch.bfloat16):
        pytest.skip("paged_prefill's AMX kernel does not serve bf16 here")
    step = make_step([(0, 100)], num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=8, seed=2)
    _, kv_cache = step.run(paged_attention_cpu)
    k_cache, v_cache, table = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], step.meta.block_tables[0]
    default = torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 100, step.scale)
    assert torch.equal(default, torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 100, step.scale, kernel=1))
    vector = torch.ops.tandem.paged_prefill(step.q, k_cache, v_cache, table, 100, step.scale, kernel=0)
    torch.testing.assert_close(default, vector, atol=TOLERANCE[torch.bfloat16], rtol=TOLERANCE[torch.bfloat16])


def test_a_decode_row_gets_the_same_bits_alone_and_in_any_batch() -> None:
    """bf16, SmolLM2's heads: each sequence of a long decode batch alone, and the batch in reverse
    order, give every row the bits it gets in the batch."""
    step = make_step(LONG_DECODE, num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, seed=4)
    batch, _ = step.run(paged_attention_cpu)
    meta = step.meta
    for s in range(meta.num_seqs):
        alone = dataclasses.replace(
            meta,
            slot_mapping=meta.slot_mapping[s : s + 1],
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=meta.seq_lens[s : s + 1],
            block_tables=meta.block_tables[s : s + 1],
            max_seq_len=int(meta.seq_lens[s]),
        )
        single = dataclasses.replace(step, q=step.q[s : s + 1], k=step.k[s : s + 1], v=step.v[s : s + 1], meta=alone)
        out, _ = single.run(paged_attention_cpu)
        assert torch.equal(out[0], batch[s]), f"sequence {s}"
    order = torch.arange(meta.num_seqs - 1, -1, -1)
    reversed_meta = dataclasses.replace(
        meta, slot_mapping=meta.slot_mapping[order], seq_lens=meta.seq_lens[order], block_tables=meta.block_tables[order]
    )
    reversed_step = dataclasses.replace(step, q=step.q[order], k=step.k[order], v=step.v[order], meta=reversed_meta)
    out, _ = reversed_step.run(paged_attention_cpu)
    assert torch.equal(out, batch[order])


@pytest.mark.parametrize("batch", [LONG_DECODE, LONG_MIXED, PREFILL_ONLY], ids=["decode", "mixed", "prefill"])
def test_a_bf16_cache_under_float32_gives_the_bits_of_its_values_widened(batch: list[tuple[int, int]]) -> None:
    """kv_cache_dtype bf16 under a float32 engine: the new K and V are rounded into the cache as
    torch rounds them, and decode rows and prefill chunks read the bf16 rows in place with the
    bits they get from the same values in a float32 cache; within float32 tolerance of the
    reference, which widens the cache it gathers."""
    step = make_step(batch, num_heads=9, num_kv_heads=3, head_dim=64, seed=5)
    bf16_step = dataclasses.replace(step, kv_cache=step.kv_cache.to(torch.bfloat16))
    out, kv_cache = bf16_step.run(paged_attention_cpu)
    expected, expected_cache = bf16_step.run(paged_attention_reference)
    assert kv_cache.dtype == torch.bfloat16 and torch.equal(kv_cache, expected_cache)
    rounded = dataclasses.replace(step, k=step.k.bfloat16().float(), v=step.v.bfloat16().float(), kv_cache=kv_cache.float())
    widened, _ = rounded.run(paged_attention_cpu)  # the same values in a float32 cache
    assert out.dtype == torch.float32 and torch.equal(out, widened)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_a_q_in_a_narrower_dtype_than_the_cache_goes_the_torch_path() -> None:
    """A bf16 q over a float32 cache: no kernel takes it (the engine refuses that setting); the
    torch path still answers."""
    step = make_step(DECODE_ONLY, num_heads=6, num_kv_heads=2, dtype=torch.bfloat16, seed=5)
    fp32_step = dataclasses.replace(step, kv_cache=step.kv_cache.float())
    expected, _ = fp32_step.run(paged_attention_reference)
    out, _ = fp32_step.run(paged_attention_cpu)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
    with pytest.raises(RuntimeError, match="dtype must equal q's"):
        torch.ops.tandem.write_kv(step.k, step.v, fp32_step.kv_cache[:, LAYER, 0], fp32_step.kv_cache[:, LAYER, 1], step.meta.slot_mapping)


def test_select_attention_uses_the_cpu_kernels_on_the_cpu() -> None:
    assert select_attention("cpu") is paged_attention_cpu


@pytest.mark.parametrize("name", ["decode_attention.cpp", "vector.h"], ids=["a-source", "a-header"])
def test_the_cache_folder_changes_with_any_kernel_file(tmp_path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """An edited kernel file, a shared header as much as a source, is built afresh, not loaded from
    the old copy; an unedited copy of the files keeps the key."""
    before = cpu_extension.build_folder(tmp_path)
    sources = shutil.copytree(cpu_extension.SOURCE_DIR, tmp_path / "cpu")
    monkeypatch.setattr(cpu_extension, "SOURCE_DIR", sources)
    assert cpu_extension.build_folder(tmp_path) == before
    edited = sources / name
    edited.write_bytes(edited.read_bytes() + b"\n// edited\n")
    assert cpu_extension.build_folder(tmp_path) != before
    assert before.parent == tmp_path


@pytest.mark.real_model
def test_greedy_smollm2_answers_are_token_identical_to_the_reference_attention() -> None:
    """The embedded SmolLM2, four chat prompts answered together, 40 greedy tokens each: the same
    tokens with these kernels as with the reference attention. In float32: in bf16 the attention
    output's last-bit rounding flips near ties, so the torch path and these kernels alike part
    from the reference within 12-30 tokens on some of these prompts."""
    loaded = load_model(None, torch.float32, "cpu", paged_attention_cpu)
    tokenizer = loaded.tokenizer
    questions = ("What is the capital of France?", "Write a haiku about rain.", "Explain what a CPU cache is.", "List three fruits.")
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]

    def answers() -> list[list[int]]:
        engine = Engine(loaded, EngineConfig(num_kv_blocks=64))
        requests = [Request(f"r{i}", tuple(p), SamplingOptions(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)]
        outputs = engine.generate(requests)
        return [[t for output in outputs[r.request_id] for t in output.new_token_ids] for r in requests]

    ours = answers()
    for layer in loaded.model.model.layers:
        layer.self_attn.attention = paged_attention_reference
    assert ours == answers()


@pytest.mark.real_model
def test_greedy_smollm2_over_a_bf16_cache_answers_as_the_reference_over_the_same_cache() -> None:
    """A float32 engine with kv_cache_dtype bf16: the embedded SmolLM2's greedy answers through
    these kernels are the reference attention's over the same bf16 cache, and the engine holds
    twice the blocks in the same memory."""
    loaded = load_model(None, torch.float32, "cpu", paged_attention_cpu)
    tokenizer = loaded.tokenizer
    questions = ("What is the capital of France?", "Write a haiku about rain.", "List three fruits.")
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]

    def answers(kv_cache_dtype: torch.dtype) -> list[list[int]]:
        engine = Engine(loaded, EngineConfig(kv_cache_mib=16, kv_cache_dtype=kv_cache_dtype))
        num_blocks[kv_cache_dtype] = engine.kv_shape.num_blocks
        assert engine.block_view(0).dtype == kv_cache_dtype
        requests = [Request(f"r{i}", tuple(p), SamplingOptions(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)]
        outputs = engine.generate(requests)
        return [[t for output in outputs[r.request_id] for t in output.new_token_ids] for r in requests]

    num_blocks: dict[torch.dtype, int] = {}
    ours = answers(torch.bfloat16)
    for layer in loaded.model.model.layers:
        layer.self_attn.attention = paged_attention_reference
    assert ours == answers(torch.bfloat16)
    answers(torch.float32)
    assert num_blocks[torch.bfloat16] // 2 == num_blocks[torch.float32]  # (whole blocks in 16 MiB)


def test_rms_norm_gives_the_torch_norms_bits_in_bf16_and_its_values_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(6)
    for dtype, tolerance in ((torch.bfloat16, 0.0), (torch.float32, 1e-6)):
        norm = RMSNorm(576, 1e-5).to(dtype)
        norm.weight.data = torch.randn(576, generator=generator).to(dtype)
        x = (3 * torch.randn(300, 576, generator=generator)).to(dtype)
        fused = norm(x)
        with monkeypatch.context() as patch:
            patch.setattr(cpu_extension, "load", lambda: False)
            plain = norm(x)
        torch.testing.assert_close(fused, plain, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_rms_norm_gives_the_residual_add_and_the_norm_after_it_their_own_bits(dtype: torch.dtype) -> None:
    """The residual h + added as torch adds it, and rms_norm's bits on that sum: what the two
    calls give one after the other, for one row and for rows split over threads."""
    generator = torch.Generator().manual_seed(10)
    weight = torch.randn(576, generator=generator).to(dtype)
    for rows in (1, 300):
        h = (3 * torch.randn(rows, 576, generator=generator)).to(dtype)
        added = torch.randn(rows, 576, generator=generator).to(dtype)
        total, normed = torch.ops.tandem.add_rms_norm(h, added, weight, 1e-5)
        assert torch.equal(total, h + added)
        assert torch.equal(normed, torch.ops.tandem.rms_norm(h + added, weight, 1e-5))
        assert not torch.equal(normed, torch.ops.tandem.rms_norm(h, weight, 1e-5))  # the norm is of the sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_qk_splits_and_rotates_with_apply_rotarys_bits(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim, tokens = 9, 3, 64, 200
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.randn(tokens, 1, head_dim, generator=generator)  # as RotaryEmbedding gives them: chunks of one table
    cos, sin = angles.cos().chunk(2, dim=-1)[0], angles.sin().chunk(2, dim=-1)[1]
    q, k = torch.ops.tandem.rotary_qk(qkv, cos, sin, num_heads, num_kv_heads)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert torch.equal(q, apply_rotary(qkv[:, :q_size].reshape(tokens, num_heads, head_dim), cos, sin))
    assert torch.equal(k, apply_rotary(qkv[:, q_size : q_size + kv_size].reshape(tokens, num_kv_heads, head_dim), cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [1536, 64, 100], ids=["smollm2", "one-vector-pair", "torch-path"])
def test_silu_mul_gives_torchs_silu_times_up_bit_for_bit(width: int, dtype: torch.dtype) -> None:
    """One row, a decode batch and a prefill chunk (split over threads), values from 0.01 to 300 in
    size with NaN, infinities and a gate where e^-x overflows: the fused kernel's bits are torch's."""
    generator = torch.Generator().manual_seed(8)
    for rows in (1, 7, 300):
        magnitude = torch.tensor([0.01, 1.0, 4.0, 30.0, 300.0])[torch.randint(0, 5, (rows, 2 * width), generator=generator)]
        gate_up = (magnitude * torch.randn(rows, 2 * width, generator=generator)).to(dtype)
        gate_up[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -88.5, -100.0])
        gate, up = gate_up.chunk(2, dim=-1)
        fused, plain = torch.ops.tandem.silu_mul(gate_up), F.silu(gate) * up
        assert fused.shape == plain.shape and fused.is_contiguous()
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # NaN's bits too
        assert torch.equal(fused.view(bits), plain.view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64-torch-path"])
def test_argmax_rows_answers_as_torch_argmax_does(dtype: torch.dtype) -> None:
    """SmolLM2's vocabulary and lengths around the kernel's 16 lanes and 4 chains, with ties (the
    first of equal values), rows of -inf, NaN (the first NaN) and infinity, rows apart in memory."""
    generator = torch.Generator().manual_seed(10)
    rows = [torch.randn(33, 49152, generator=generator)]
    for length in (1, 7, 16, 17, 64, 65, 100, 129):
        rows.append(torch.randint(-3, 3, (9, length), generator=generator).float())  # many ties
        rows.append(torch.randn(9, length, generator=generator))
    special = torch.randn(6, 100, generator=generator)
    special[0] = -float("inf")
    special[1, 37], special[1, 80], special[1, 90] = float("nan"), float("nan"), float("inf")
    special[2, 99] = float("nan")
    special[3, 5], special[3, 70] = float("inf"), float("inf")
    special[4, 0] = -float("inf")
    rows.append(special)
    for logits in rows:
        logits = logits.to(dtype)
        assert torch.equal(torch.ops.tandem.argmax_rows(logits), logits.argmax(dim=-1)), logits.shape
        apart = torch.cat([logits, logits], dim=1)[:, 1:]  # rows twice their length apart, one column in
        assert torch.equal(torch.ops.tandem.argmax_rows(apart), apart.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="logits must be"):
        torch.ops.tandem.argmax_rows(torch.zeros(8))
    with pytest.raises(RuntimeError, match="logits must be"):
        torch.ops.tandem.argmax_rows(torch.zeros(2, 0))


def test_an_mlp_on_the_cpu_takes_silu_mul_with_the_torch_ops_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(9)
    mlp = GatedMLP(576, 1536).to(torch.bfloat16)
    for parameter in mlp.parameters():
        parameter.data = (0.05 * torch.randn(parameter.shape, generator=generator)).bfloat16()
    x = torch.randn(40, 576, generator=generator).bfloat16()
    calls = []
    silu_mul = torch.ops.tandem.silu_mul
    with monkeypatch.context() as patch:
        patch.setattr(torch.ops.tandem, "silu_mul", lambda gate_up: calls.append(gate_up.shape) or silu_mul(gate_up))
        fused = mlp(x)
    assert calls == [(40, 3072)]
    with monkeypatch.context() as patch:
        patch.setattr(cpu_extension, "load", lambda: False)
        plain = mlp(x)
    assert torch.equal(fused, plain)


def test_the_kernels_refuse_malformed_input_with_an_error_not_a_crash() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.tandem.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        torch.ops.tandem.silu_mul(torch.randn(4, 7))
    assert torch.ops.tandem.silu_mul(torch.randn(4, 0)).shape == (4, 0)  # no columns: no division by zero width
    with pytest.raises(RuntimeError, match="added must be"):
        torch.ops.tandem.add_rms_norm(x, torch.randn(4, 7), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="width must be"):
        torch.ops.tandem.rotary_qk(torch.randn(4, 70), torch.ones(4, 1, 2), torch.ones(4, 1, 2), 2, 1)
    step = make_step(DECODE_ONLY, num_heads=6, num_kv_heads=2)
    cache = step.kv_cache[:, LAYER, 0]
    with pytest.raises(RuntimeError, match="seq_lens"):
        torch.ops.tandem.paged_decode(step.q, cache, cache, step.meta.seq_lens.long(), step.meta.block_tables, 1.0)
    outside = step.meta.block_tables.clone()
    outside[0, 0] = cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.tandem.paged_decode(step.q, cache, cache, step.meta.seq_lens, outside, 1.0)
    too_long = step.meta.seq_lens.clone()
    too_long[0] = step.meta.block_tables.shape[1] * cache.shape[1] + 1
    with pytest.raises(RuntimeError, match="outside its block table"):
        torch.ops.tandem.paged_decode(step.q, cache, cache, too_long, step.meta.block_tables, 1.0)
    table, q = step.meta.block_tables[0], torch.randn(8, 6, 32)
    with pytest.raises(RuntimeError, match="does not serve head_dim 32"):
        torch.ops.tandem.paged_prefill(q, cache, cache, table, 8, 1.0)
    prefill = make_step(PREFILL_ONLY, num_heads=6, num_kv_heads=2, head_dim=64)
    cache, table, q = prefill.kv_cache[:, LAYER, 0], prefill.meta.block_tables[0], prefill.q[:33]
    with pytest.raises(RuntimeError, match="outside its block table"):
        torch.ops.tandem.paged_prefill(q, cache, cache, table, 32, 1.0)  # a chunk longer than its context
    with pytest.raises(RuntimeError, match="outside its block table"):
        torch.ops.tandem.paged_prefill(q, cache, cache, table, table.shape[0] * cache.shape[1] + 1, 1.0)
    outside = table.clone()
    outside[0] = cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.tandem.paged_prefill(q, cache, cache, outside, 33, 1.0)
    with pytest.raises(RuntimeError, match="block_table"):
        torch.ops.tandem.paged_prefill(q, cache, cache, table.long(), 33, 1.0)


needs_int8_mm = pytest.mark.skipif(
    not (cpu_extension.load() and torch.ops.tandem.int8_mm_supported(1, 64, torch.bfloat16)),
    reason="int8_mm needs AVX512-BF16 (bf16 dot products)",
)


@needs_int8_mm
@pytest.mark.parametrize("out_features", [96, 97], ids=["even-channels", "odd-channels"])
def test_int8_mm_matches_the_dequantized_product_and_a_row_s_bits_are_its_own(out_features: int) -> None:
    """Up to 16 rows of bf16 against an int8 weight and its scales: the float32 product of the
    dequantized weight within bf16 rounding, and each row with the bits it gets alone."""
    generator = torch.Generator().manual_seed(6)
    weight = torch.randint(-127, 128, (out_features, 192), generator=generator, dtype=torch.int8)
    scale = (torch.rand(out_features, generator=generator) / 100).to(torch.bfloat16)
    x = torch.randn(16, 192, generator=generator).to(torch.bfloat16)
    for rows in (1, 3, 8, 9, 16):
        out = torch.ops.tandem.int8_mm(x[:rows], weight, scale)
        expected = x[:rows].float() @ (weight.float() * scale.float()[:, None]).T
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
        for i in range(rows):
            assert torch.equal(torch.ops.tandem.int8_mm(x[i : i + 1], weight, scale)[0], out[i]), f"row {i} of {rows}"


@needs_int8_mm
def test_an_int8_layer_multiplies_a_decode_batch_with_int8_mm_on_the_cpu() -> None:
    layer = Int8Linear.from_linear(torch.nn.Linear(192, 64, bias=True).to(torch.bfloat16))
    x = torch.randn(5, 192).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), torch.ops.tandem.int8_mm(x, layer.weight_int8, layer.scale) + layer.bias)


def test_int8_mm_refuses_malformed_input_with_an_error_not_a_crash() -> None:
    weight, scale = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.tandem.int8_mm(torch.zeros(2, 64, dtype=torch.bfloat16), weight.float(), scale)
    with pytest.raises(RuntimeError, match="scale must be"):
        torch.ops.tandem.int8_mm(torch.zeros(2, 64, dtype=torch.bfloat16), weight, scale[:4])
    with pytest.raises(RuntimeError, match="does not serve 17 rows"):
        torch.ops.tandem.int8_mm(torch.zeros(17, 64, dtype=torch.bfloat16), weight, scale)
    with pytest.raises(RuntimeError, match="does not serve"):
        torch.ops.tandem.int8_mm(torch.zeros(2, 64), weight, scale.float())  # float32 activations


def _packed_serves(dtype: torch.dtype) -> bool:
    return cpu_extension.load() and bool(torch.ops.tandem.packed_mm_supported(16, 64, dtype, dtype))


PACKED_DTYPES = [
    pytest.param(
        torch.bfloat16,
        id="bf16",
        marks=pytest.mark.skipif(not _packed_serves(torch.bfloat16), reason="bf16 rows need AVX512-BF16 (bf16 dot products)"),
    ),
    pytest.param(
        torch.float32, id="fp32", marks=pytest.mark.skipif(not _packed_serves(torch.float32), reason="float32 rows need AVX2 and FMA")
    ),
]
# packed_mm against the float64 product: bf16 rows and outputs round at 2^-8, float32 ones at 2^-24.
PACKED_TOLERANCE = {torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("out_features", [16, 32, 48, 64, 960], ids=lambda n: f"{n}-channels")
@pytest.mark.parametrize("num_threads", [1, 2])
def test_packed_mm_matches_the_float_product_and_a_row_s_bits_are_its_own(out_features: int, num_threads: int, dtype: torch.dtype) -> None:
    """Rows against a packed weight of their dtype, tiles of 1, 2 and 3 channel groups and every
    tile height: the float64 product within the dtype's rounding, and every row with the bits it
    gets alone, whatever the number of rows beside it and the threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        generator = torch.Generator().manual_seed(7)
        weight = (torch.randn(out_features, 576, generator=generator) * 0.05).to(dtype)
        packed = torch.ops.tandem.pack_weight(weight, dtype)
        x = torch.randn(37, 576, generator=generator).to(dtype)
        alone = torch.cat([torch.ops.tandem.packed_mm(x[i : i + 1], packed) for i in range(x.shape[0])])
        for rows in (1, 2, 3, 5, 6, 7, 8, 9, 37):
            out = torch.ops.tandem.packed_mm(x[:rows], packed)
            assert out.dtype == dtype and out.shape == (rows, out_features)
            torch.testing.assert_close(out.double(), x[:rows].double() @ weight.double().T, **PACKED_TOLERANCE[dtype])
            assert torch.equal(out, alone[:rows]), f"{rows} rows"
        strided = torch.ops.tandem.packed_mm(torch.cat([x, x], dim=1)[:, :576], packed)  # rows 1,152 elements apart
        assert torch.equal(strided, alone)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_packed_mm_with_an_int8_weight_scales_each_channel_s_sum(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(8)
    weight = torch.randint(-127, 128, (48, 192), generator=generator, dtype=torch.int8)
    scale = (torch.rand(48, generator=generator) / 100).to(dtype)
    packed = torch.ops.tandem.pack_weight(weight, dtype)
    x = torch.randn(12, 192, generator=generator).to(dtype)
    out = torch.ops.tandem.packed_mm(x, packed, scale)
    torch.testing.assert_close(out.double(), x.double() @ (weight.double() * scale.double()[:, None]).T, **PACKED_TOLERANCE[dtype])
    assert torch.equal(out, torch.cat([torch.ops.tandem.packed_mm(x[i : i + 1], packed, scale) for i in range(12)]))
    with pytest.raises(RuntimeError, match="takes a scale per channel"):
        torch.ops.tandem.packed_mm(x, packed)
    with pytest.raises(RuntimeError, match="scale must be"):
        torch.ops.tandem.packed_mm(x, packed, scale[:16])


@pytest.mark.skipif(not _packed_serves(torch.bfloat16), reason="packed_mm serves bf16 rows on a CPU with AVX512-BF16")
def test_packed_mm_widens_every_int8_value_exactly() -> None:
    """An int8 weight under a scale of 1 gives the bits of the same weight as bf16 (each value is
    exact there): every value from -127 to 127, for the rows of a decode step and of a prefill,
    whose tiles widen the packed bytes in different places. -128, and an odd number of input
    pairs, are refused."""
    generator = torch.Generator().manual_seed(9)
    values = torch.arange(-127, 128, dtype=torch.int8)
    weight = values[torch.randperm(48 * 320, generator=generator) % values.numel()].reshape(48, 320)
    as_bf16 = torch.ops.tandem.pack_weight(weight.to(torch.bfloat16), torch.bfloat16)
    packed = torch.ops.tandem.pack_weight(weight, torch.bfloat16)
    ones = torch.ones(48, dtype=torch.bfloat16)
    x = torch.randn(12, 320, generator=generator).to(torch.bfloat16)
    for rows in (1, 2, 8, 12):
        assert torch.equal(torch.ops.tandem.packed_mm(x[:rows], packed, ones), torch.ops.tandem.packed_mm(x[:rows], as_bf16)), (
            f"{rows} rows"
        )
    with pytest.raises(RuntimeError, match="-127..127"):
        torch.ops.tandem.pack_weight(torch.full((16, 64), -128, dtype=torch.int8), torch.bfloat16)
    with pytest.raises(RuntimeError, match="does not serve"):
        torch.ops.tandem.pack_weight(torch.zeros(16, 66, dtype=torch.int8), torch.bfloat16)


def test_packed_mm_refuses_malformed_input_with_an_error_not_a_crash() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        with pytest.raises(RuntimeError, match="does not serve"):
            torch.ops.tandem.pack_weight(torch.zeros(24, 64, dtype=dtype), dtype)  # not a multiple of 16 channels
        with pytest.raises(RuntimeError, match="does not serve"):
            torch.ops.tandem.pack_weight(torch.zeros(32, 64, dtype=torch.float16), dtype)  # a weight type neither path takes
    with pytest.raises(RuntimeError, match="does not serve"):
        torch.ops.tandem.pack_weight(torch.zeros(32, 64), torch.float16)  # rows of a type neither path takes
    for dtype in (torch.bfloat16, torch.float32):
        if not _packed_serves(dtype):
            continue
        weight = torch.zeros(32, 64, dtype=dtype)
        packed = torch.ops.tandem.pack_weight(weight, dtype)
        with pytest.raises(RuntimeError, match="pack_weight's"):
            torch.ops.tandem.packed_mm(torch.zeros(2, 62, dtype=dtype), packed)
        with pytest.raises(RuntimeError, match="pack_weight's"):
            torch.ops.tandem.packed_mm(torch.zeros(2, 64, dtype=dtype), weight)  # not packed
        other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
        with pytest.raises(RuntimeError, match="pack_weight's"):
            torch.ops.tandem.packed_mm(torch.zeros(2, 64, dtype=other), packed)  # rows of another type than the weight's
        with pytest.raises(RuntimeError, match="x must be bf16 or float32"):
            torch.ops.tandem.packed_mm(torch.zeros(2, 64, dtype=torch.float16), packed)
