"""A row's bits do not depend on the rows batched with it (CPU, bf16): a greedy answer is the same
whoever shares its steps, so a continued or resumed reply can equal the undisturbed one."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.engine.runner import Runner
from tandem.engine.sampling import Sampler
from tandem.engine.sequence import SamplingOptions, Sequence
from tandem.engine.step_plan import ScheduledChunk, StepPlan
from tandem.kernels import select_attention
from tandem.kernels.metadata import KvCacheShape
from tandem.models import layers
from tandem.models.loader import LoadedModel, load_model
from tandem.models.quant import INT8_KERNEL_MAX_ROWS, Int8Linear

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def smollm2_bf16() -> LoadedModel:
    return load_model(None, torch.bfloat16, "cpu", select_attention("cpu"))


@pytest.mark.parametrize("num_threads", [1, 2])
def test_each_projection_gives_a_row_in_a_long_call_the_bits_it_gets_alone(num_threads):
    """SmolLM2-135M's four projection shapes (out, in), 600 rows (a prefill chunk plus decodes),
    against each row alone (a decode-only step of one sequence)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        generator = torch.Generator().manual_seed(0)
        for out_features, in_features in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
            linear = torch.nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
            x = torch.randn(600, in_features, generator=generator).to(torch.bfloat16)
            with torch.no_grad():
                batched = layers.project(linear, x)
                alone = torch.cat([layers.project(linear, x[i : i + 1]) for i in range(x.shape[0])])
            assert torch.equal(batched, alone), f"({out_features}, {in_features}): rows differ from their single-row result"
    finally:
        torch.set_num_threads(previous)


def test_an_int8_projection_gives_a_row_alone_the_bits_it_gets_in_a_small_batch():
    """int8 weights, the row counts its fused kernel takes (up to INT8_KERNEL_MAX_ROWS): a decode
    row alone, as project computes it, against the same row among up to 12."""
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
        linear = torch.nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
        int8 = Int8Linear.from_linear(linear)
        x = torch.randn(INT8_KERNEL_MAX_ROWS, in_features, generator=generator).to(torch.bfloat16)
        with torch.no_grad():
            for rows in range(2, INT8_KERNEL_MAX_ROWS + 1):
                batched = layers.project(int8, x[:rows])
                for i in range(rows):
                    assert torch.equal(layers.project(int8, x[i : i + 1])[0], batched[i]), (
                        f"({out_features}, {in_features}), row {i} of {rows}"
                    )


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_an_int8_projection_over_many_rows_casts_its_weight_once_and_gives_each_call_s_bits(bias: bool):
    """Past CPU_ROWS_PER_MATMUL rows, project casts an int8 weight once for all its calls; each
    row still gets what the layer's own forward gives it in a call of those rows."""
    generator = torch.Generator().manual_seed(2)
    for out_features, in_features in [(960, 576), (3072, 576), (576, 1536)]:
        linear = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
        int8 = Int8Linear.from_linear(linear)
        x = torch.randn(600, in_features, generator=generator).to(torch.bfloat16)
        with torch.no_grad():
            tiled = layers.project(int8, x)
            per_call = torch.cat([int8(rows) for rows in x.split(layers.CPU_ROWS_PER_MATMUL)])
        assert tiled.dtype == torch.bfloat16 and torch.equal(tiled, per_call), f"({out_features}, {in_features})"


def _sequence(seq_id: str, num_tokens: int, first_block: int, salt: int) -> Sequence:
    prompt = [(97 * salt + 13 * j) % 40_000 + 100 for j in range(num_tokens)]
    seq = Sequence(seq_id, prompt, SamplingOptions(max_tokens=100, ignore_eos=True))
    seq.append_blocks(range(first_block, first_block + 20))
    seq.admit()
    return seq


def _kv_at(kv_cache: torch.Tensor, seq: Sequence, position: int) -> torch.Tensor:
    """Every layer's K and V of one position: (layers, 2, kv_heads, head_dim)."""
    return kv_cache[seq.block_table[position // BLOCK_SIZE]][:, :, position % BLOCK_SIZE].clone()


@pytest.mark.real_model
def test_decode_rows_sharing_a_step_with_a_prefill_chunk_get_the_bits_of_a_decode_only_step(smollm2_bf16):
    """Eight decodes alone, then the same eight alongside a 300-token prompt on a copy of the same
    cache: every layer's K and V at each decode's position, and its sampled token, are equal.
    Without layers.project's row limit about one decode row in six differs here."""
    config = smollm2_bf16.config
    shape = KvCacheShape(400, config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim).as_tuple()
    for trial in range(4):
        prefilled = Runner(smollm2_bf16.model, torch.zeros(shape, dtype=torch.bfloat16), BLOCK_SIZE, Sampler())
        decodes = [_sequence(f"d{i}", 20 + 3 * i, 20 * i, salt=10 * trial + i) for i in range(8)]
        for seq in decodes:
            token = prefilled.execute(StepPlan(scheduled=[ScheduledChunk(seq, seq.num_tokens)])).token_ids[seq.seq_id]
            seq.advance_computed(seq.num_tokens)
            seq.append_token(token)
        cache = prefilled.kv_cache.clone()

        alone = copy.deepcopy(decodes)
        alone_tokens = prefilled.execute(StepPlan(scheduled=[ScheduledChunk(seq, 1) for seq in alone])).token_ids
        mixed_runner = Runner(smollm2_bf16.model, cache, BLOCK_SIZE, Sampler())
        mixed = copy.deepcopy(decodes)
        prompt = _sequence("prompt", 300, 200, salt=999 + trial)
        mixed_tokens = mixed_runner.execute(
            StepPlan(scheduled=[ScheduledChunk(seq, 1) for seq in mixed] + [ScheduledChunk(prompt, 300)])
        ).token_ids

        for a, m in zip(alone, mixed):
            position = a.num_tokens - 1
            assert torch.equal(_kv_at(prefilled.kv_cache, a, position), _kv_at(mixed_runner.kv_cache, m, position)), (
                f"trial {trial}, {a.seq_id}: K/V differ when a prefill chunk shares the step"
            )
            assert alone_tokens[a.seq_id] == mixed_tokens[m.seq_id]
