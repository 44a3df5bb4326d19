"""An FP8 e4m3 KV cache (`--kv-cache-dtype fp8`): every CPU backend stores k and v saturated to
+-448 and rounded as torch rounds them, reads every e4m3 value exactly, and agrees with the
reference over the same cache; an engine generates through the C++ kernels over it with the
reference's tokens and holds four times the blocks of a float32 cache in the same memory.

Tolerances: a backend against the reference reads the same e4m3 values, so only the arithmetic
differs (paged_batches.TOLERANCE, as for a cache of q's dtype). Against a float32 cache the
rounding itself shows: e4m3 keeps 3 mantissa bits, each stored value within 2^-4 of itself
relatively: attention over random unit-variance k and v moved by 0.12 at most, 0.005 on average
(seed 22), checked against 0.25 and 0.01."""

from __future__ import annotations

import pytest
import torch
from paged_batches import LAYER, LONG_DECODE, LONG_MIXED, MIXED, PREFILL_ONLY, TOLERANCE, make_step
from reference_model import random_model, tiny_config, word_tokenizer

from tandem.config import Settings
from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.errors import StartupError
from tandem.kernels import cpu_extension, paged_attention_cpu, paged_attention_reference, paged_attention_torch
from tandem.kernels.attention_cpu import kernels_take
from tandem.kernels.metadata import AttentionMetadata
from tandem.models.loader import LoadedModel, resolve_kv_cache_dtype

FP8 = torch.float8_e4m3fn
needs_kernels = pytest.mark.skipif(not cpu_extension.load(), reason="the C++ CPU kernels do not build here (no C++ compiler?)")
BACKENDS = {"torch": paged_attention_torch, "cpu": pytest.param(paged_attention_cpu, marks=needs_kernels)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [MIXED, LONG_MIXED, LONG_DECODE, PREFILL_ONLY], ids=["mixed", "long_mixed", "long_decode", "prefill"])
@pytest.mark.parametrize("attention", BACKENDS.values(), ids=BACKENDS.keys())
def test_backends_match_the_reference_over_an_fp8_cache(attention, batch: list[tuple[int, int]], dtype: torch.dtype) -> None:
    step = make_step(batch, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype, cache_dtype=FP8, seed=21)
    expected, expected_cache = step.run(paged_attention_reference, window=40)
    out, kv_cache = step.run(attention, window=40)
    assert out.dtype == dtype and kv_cache.dtype == FP8
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(kv_cache, expected_cache)


def test_attention_over_an_fp8_cache_is_within_e4m3s_rounding_of_a_float32_cache() -> None:
    step = make_step(LONG_MIXED, num_heads=9, num_kv_heads=3, head_dim=64, seed=22)
    exact, _ = step.run(paged_attention_reference)
    fp8_step = make_step(LONG_MIXED, num_heads=9, num_kv_heads=3, head_dim=64, cache_dtype=FP8, seed=22)
    assert torch.equal(fp8_step.kv_cache, step.kv_cache.to(FP8))
    rounded, _ = fp8_step.run(paged_attention_reference)
    error = (rounded - exact).abs()
    assert 1e-3 < error.max() < 0.25 and error.mean() < 0.01


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_saturates_and_rounds_into_an_fp8_cache_as_torch_does(dtype: torch.dtype) -> None:
    step = make_step(MIXED, num_heads=6, num_kv_heads=2, dtype=dtype, cache_dtype=FP8, seed=23)
    k, v = 100 * step.k, step.v / 1000  # past +-448, and e4m3's subnormals (below 2^-6)
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, float("nan")])
    kv_cache = step.kv_cache.clone()
    torch.ops.tandem.write_kv(k, v, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], step.meta.slot_mapping)
    step.k, step.v = k, v
    expected = step.expected_cache()
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))  # NaN's byte too
    written = kv_cache[:, LAYER, 0].reshape(-1, 2, 32)[step.meta.slot_mapping[0], 0, :4].float()
    assert written[:3].tolist() == [448.0, -448.0, 448.0] and written[3].isnan()


@needs_kernels
@pytest.mark.parametrize("head_dim", [128, 40], ids=["vector_path", "plain_loops"])
def test_paged_decode_reads_every_finite_e4m3_value_exactly(head_dim: int) -> None:
    """A window of one: each row's output is its own V row, read from the cache. Two kv heads of
    128 lanes hold all 256 bytes (NaN's two as zero), and 40 lanes the first 80."""
    num_bytes = 2 * head_dim
    values = torch.arange(num_bytes, dtype=torch.uint8)
    values[(values & 0x7F) == 0x7F] = 0
    v = values.view(FP8).float().view(1, 2, head_dim)
    cache = torch.zeros(2, 16, 2, head_dim, dtype=FP8)
    q, k = torch.randn(1, 2, head_dim), torch.randn(1, 2, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([20]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([21], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=21,
        is_decode_only=True,
    )
    out = paged_attention_cpu(q, k, v, cache, cache.clone(), meta, 0.125, window=1)
    assert torch.equal(out, v)


def test_the_kernels_take_an_fp8_cache_under_float32_and_bf16() -> None:
    assert kernels_take(torch.float32, FP8) and kernels_take(torch.bfloat16, FP8)
    assert not kernels_take(torch.float16, FP8)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_is_a_kv_cache_dtype_under_any_engine(device: str, dtype: torch.dtype) -> None:
    assert resolve_kv_cache_dtype("fp8", dtype, device) == FP8
    assert Settings(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(StartupError, match="TANDEM_KV_CACHE_DTYPE=fp32 under a bfloat16 engine"):
        resolve_kv_cache_dtype("fp32", torch.bfloat16, device)


def test_fp8_on_a_gpu_before_compute_capability_8_9_stops_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "an A100")
    with pytest.raises(StartupError, match="^TANDEM_KV_CACHE_DTYPE=fp8 on an A100: .* needs compute capability 8.9 or later$"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, "cuda")
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, "cpu") == FP8


@needs_kernels
def test_an_engine_over_an_fp8_cache_generates_the_references_tokens_in_a_quarter_of_the_memory() -> None:
    """A tiny float32 model (head size 64, so paged_decode's and paged_prefill's vector paths):
    greedy tokens through the C++ kernels over an FP8 cache are the reference attention's over
    the same cache; a 1 MiB cache holds four times the blocks of a float32 one."""
    config = tiny_config(head_dim=64, num_heads=4, num_kv_heads=2, max_position_embeddings=512)
    generator = torch.Generator().manual_seed(24)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (5, 40, 90)]

    def generate(attention, kv_cache_dtype: torch.dtype) -> tuple[list[list[int]], int]:
        model = random_model(config, seed=0, attention=attention).eval()
        loaded = LoadedModel(model=model, config=config, tokenizer=word_tokenizer(config.vocab_size))
        engine = Engine(loaded, EngineConfig(kv_cache_mib=1, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32))
        assert engine.block_view(0).dtype == kv_cache_dtype
        requests = [Request(f"r{i}", tuple(p), SamplingOptions(max_tokens=12, ignore_eos=True)) for i, p in enumerate(prompts)]
        outputs = engine.generate(requests)
        return [[t for output in outputs[r.request_id] for t in output.new_token_ids] for r in requests], engine.kv_shape.num_blocks

    ours, fp8_blocks = generate(paged_attention_cpu, FP8)
    reference, _ = generate(paged_attention_reference, FP8)
    assert ours == reference and all(len(tokens) == 12 for tokens in ours)
    _, fp32_blocks = generate(paged_attention_cpu, torch.float32)
    assert fp8_blocks == 4 * fp32_blocks
