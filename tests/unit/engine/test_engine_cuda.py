"""The engine on a GPU (skipped without one): the triton attention kernel serving prefill and
decode, with decode steps as CUDA graphs or eagerly, gives the naive reference forward's greedy
tokens; on the real SmolLM2 in bf16 too."""

from __future__ import annotations

import pytest
import torch
from reference_model import dequantized_copy, random_model, reference_greedy, tiny_config
from test_engine import byte_level_tokenizer, seeded_prompts

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import is_triton_available, paged_attention_triton, select_attention
from tandem.models.loader import LoadedModel, load_model
from tandem.models.quant import quantize_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not is_triton_available(), reason="needs a CUDA GPU and triton")

NUM_NEW_TOKENS = 12


def greedy_tokens(engine: Engine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    batch = [Request(f"r{i}", tuple(p), SamplingOptions(max_tokens=num_tokens, ignore_eos=True)) for i, p in enumerate(prompts)]
    streams = engine.generate(batch)
    return [[t for out in streams[f"r{i}"] for t in out.new_token_ids] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny_cuda() -> LoadedModel:
    config = tiny_config(vocab_size=512, max_position_embeddings=1024)
    model = random_model(config, seed=0, attention=paged_attention_triton).to("cuda")
    return LoadedModel(model=model.eval(), config=config, tokenizer=byte_level_tokenizer(config.vocab_size))


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_batched_chunked_steps_on_cuda_equal_the_naive_reference(tiny_cuda: LoadedModel, enforce_eager: bool) -> None:
    prompts = seeded_prompts(20)
    expected = [reference_greedy(tiny_cuda.model, p, NUM_NEW_TOKENS) for p in prompts]
    config = EngineConfig(num_kv_blocks=400, max_num_batched_tokens=48, enforce_eager=enforce_eager)
    engine = Engine(tiny_cuda, config)
    assert (engine.runner.graphs is None) == enforce_eager
    assert greedy_tokens(engine, prompts, NUM_NEW_TOKENS) == expected
    assert greedy_tokens(engine, prompts, NUM_NEW_TOKENS) == expected, "warm: prefix-cache hits"
    if not enforce_eager:
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.num_steps >= 2 * (NUM_NEW_TOKENS - 1), "decode steps were replayed graphs"


@pytest.mark.parametrize(("enforce_eager", "chunk"), [(False, 48), (True, 256)], ids=["cuda_graphs-kernel_prefill", "eager-cast_prefill"])
def test_int8_weights_on_cuda_give_the_dequantized_reference_tokens(enforce_eager: bool, chunk: int) -> None:
    """Decode steps multiply through the int8 triton kernel; prefill chunks of 48 rows do too,
    chunks of 256 through the cast weight. The reference holds int8 * scale in plain Linears."""
    config = tiny_config(vocab_size=512, max_position_embeddings=1024)
    model = quantize_model(random_model(config, seed=0, attention=paged_attention_triton), "int8").to("cuda").eval()
    reference = dequantized_copy(model).eval()
    prompts = seeded_prompts(20)
    expected = [reference_greedy(reference, p, NUM_NEW_TOKENS) for p in prompts]
    loaded = LoadedModel(model=model, config=config, tokenizer=byte_level_tokenizer(config.vocab_size))
    engine = Engine(loaded, EngineConfig(num_kv_blocks=400, max_num_batched_tokens=chunk, enforce_eager=enforce_eager))
    assert greedy_tokens(engine, prompts, NUM_NEW_TOKENS) == expected


QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.", "What is 12 times 7?"]


def test_smollm2_in_fp32_on_cuda_gives_the_reference_greedy_tokens() -> None:
    loaded = load_model(None, torch.float32, "cuda", select_attention("cuda"))
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = [reference_greedy(loaded.model, p, 16) for p in prompts]
    assert greedy_tokens(Engine(loaded, EngineConfig(num_kv_blocks=64)), prompts, 16) == expected
    assert "Paris" in loaded.tokenizer.decode(expected[0])


def test_smollm2_in_bf16_on_cuda_gives_the_same_tokens_with_and_without_cuda_graphs() -> None:
    # bf16 rounds differently in a whole-sequence reference forward than in batched steps, so
    # the check here is graphs against eager steps (four rows: no padding, the same kernels)
    loaded = load_model(None, torch.bfloat16, "cuda", select_attention("cuda"))
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    graphed = greedy_tokens(Engine(loaded, EngineConfig(num_kv_blocks=64)), prompts, 32)
    assert greedy_tokens(Engine(loaded, EngineConfig(num_kv_blocks=64, enforce_eager=True)), prompts, 32) == graphed
    assert "Paris" in loaded.tokenizer.decode(graphed[0])
