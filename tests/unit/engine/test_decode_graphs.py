"""Decode steps through DecodeGraphs: its static buffers, batch-size buckets and padding rows (run
eagerly here, as on a machine without a GPU; on CUDA the same staging feeds a captured graph)
give an eager engine's tokens and KV cache, and the padding writes nothing but the scratch block."""

from __future__ import annotations

import pytest
import torch
from reference_model import random_model, reference_greedy, tiny_config
from test_engine import byte_level_tokenizer, seeded_prompts

from tandem.engine.decode_graphs import SIZES, DecodeGraphs
from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.runner import Runner
from tandem.engine.sampling import Sampler
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.loader import LoadedModel

NUM_BLOCKS = 200


@pytest.fixture(scope="module", params=["reference", "fastest"])
def tiny(request: pytest.FixtureRequest) -> LoadedModel:
    """The reference attention, and this CPU's fastest (its C++ kernels, which hold the metadata's
    dtypes to the contract)."""
    config = tiny_config(vocab_size=512, max_position_embeddings=1024)
    attention = paged_attention_reference if request.param == "reference" else select_attention("cpu")
    model = random_model(config, seed=3, attention=attention)
    return LoadedModel(model=model.eval(), config=config, tokenizer=byte_level_tokenizer(config.vocab_size))


def with_graphs(tiny: LoadedModel, max_batch: int, max_context: int) -> tuple[Engine, DecodeGraphs]:
    """An engine whose runner takes decode steps through DecodeGraphs, its cache one scratch block
    longer than the blocks the engine manages (as Engine allocates it on a GPU)."""
    engine = Engine(tiny, EngineConfig(num_kv_blocks=NUM_BLOCKS))
    managed = engine.runner.kv_cache
    kv_cache = torch.zeros((NUM_BLOCKS + 1, *managed.shape[1:]), dtype=managed.dtype)
    graphs = DecodeGraphs(tiny.model, kv_cache, engine.config.block_size, max_batch, max_context, capture=False)
    engine.runner = Runner(tiny.model, kv_cache, engine.config.block_size, Sampler(), graphs)
    return engine, graphs


def requests(prompts: list[list[int]]) -> list[Request]:
    """Replies of different lengths, so the decode batch shrinks through the buckets."""
    return [Request(f"r{i}", tuple(p), SamplingOptions(max_tokens=3 + 2 * i, ignore_eos=True)) for i, p in enumerate(prompts)]


def tokens(engine: Engine, batch: list[Request]) -> dict[str, list[int]]:
    return {rid: [t for out in stream for t in out.new_token_ids] for rid, stream in engine.generate(batch).items()}


def test_buckets_are_vllm_sizes_up_to_the_engine_s_batch() -> None:
    assert SIZES[:5] == (1, 2, 4, 8, 16) and all(b - a <= 32 for a, b in zip(SIZES, SIZES[1:]))


def test_padded_graph_steps_give_the_eager_tokens_and_cache_and_write_only_the_scratch_block(tiny: LoadedModel) -> None:
    prompts = seeded_prompts(11)  # 11 rows: padded to 16, then 8, 4, 2 and 1 as replies end
    batch = requests(prompts)
    eager = Engine(tiny, EngineConfig(num_kv_blocks=NUM_BLOCKS))
    expected = tokens(eager, batch)
    engine, graphs = with_graphs(tiny, max_batch=64, max_context=1024)

    assert graphs.sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert tokens(engine, batch) == expected
    assert expected["r0"] == reference_greedy(tiny.model, prompts[0], 3)
    assert graphs.num_steps == max(3 + 2 * i for i in range(11)) - 1, "every decode step went through the graphs"
    managed = engine.runner.kv_cache[:NUM_BLOCKS]
    # the same values (float32 matmuls of 16 rows round a few differently from 11) in the same slots
    torch.testing.assert_close(managed, eager.runner.kv_cache, rtol=1e-4, atol=1e-5)
    assert torch.equal(managed == 0, eager.runner.kv_cache == 0), "no slot written that the eager engine left alone"
    assert engine.runner.kv_cache[NUM_BLOCKS].abs().sum() > 0, "padding rows wrote their scratch block"


def test_a_batch_above_the_biggest_graph_or_a_context_past_its_tables_runs_eagerly(tiny: LoadedModel) -> None:
    prompts = seeded_prompts(10)  # prompts of up to 150 tokens: 10 blocks
    batch = requests(prompts[:6])
    expected = tokens(Engine(tiny, EngineConfig(num_kv_blocks=NUM_BLOCKS)), batch)
    engine, graphs = with_graphs(tiny, max_batch=3, max_context=48)  # 3 rows, 3 blocks of context
    assert graphs.sizes == (1, 2, 3)
    assert tokens(engine, batch) == expected
    decode_steps = max(3 + 2 * i for i in range(6)) - 1
    assert 0 < graphs.num_steps < decode_steps, "the steps of three rows or fewer and short contexts only"
    assert not graphs.serves(4, 1) and not graphs.serves(1, 4) and graphs.serves(3, 3)
