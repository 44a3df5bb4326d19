"""Replayed tokens: generated tokens that a prefill chunk recomputes (a continuation's, a preempted
sequence's) are computed as the decode steps that generated them were (one-row pieces of the
step's forward, on the decode attention path), so a bf16 continuation on a fresh engine is token
for token the uninterrupted run."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from reference_model import random_model, tiny_config

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.runner import Rows, Runner, forward_passes
from tandem.engine.sampling import Sampler
from tandem.engine.sequence import SamplingOptions, Sequence
from tandem.engine.step_plan import ScheduledChunk, StepPlan
from tandem.kernels import cpu_extension, paged_attention_cpu, select_attention
from tandem.kernels.attention_torch import paged_attention_torch
from tandem.kernels.metadata import KvCacheShape
from tandem.models.loader import LoadedModel, load_model

BLOCK_SIZE = 16


def sequence(seq_id: str, num_prompt: int, num_generated: int, num_computed: int, first_block: int = 0) -> Sequence:
    seq = Sequence(seq_id, range(3, 3 + num_prompt), SamplingOptions(max_tokens=1000, ignore_eos=True))
    for i in range(num_generated):
        seq.append_token(100 + i)
    num_blocks = -(-(seq.num_tokens + 1) // BLOCK_SIZE)
    seq.append_blocks(range(first_block, first_block + num_blocks))
    seq.admit()
    if num_computed:
        seq.advance_computed(num_computed)
    return seq


def test_a_step_without_generated_tokens_in_a_prefill_chunk_is_one_forward_of_its_chunks():
    decode = sequence("decode", 20, 5, 24)
    prompt = sequence("prompt", 40, 0, 0, first_block=10)
    partial = sequence("partial", 40, 0, 0, first_block=20)  # the first chunk of a long prompt
    generated_later = sequence("generated-later", 30, 5, 0, first_block=30)  # a continuation's first chunk, all prompt
    plan = StepPlan(
        scheduled=[ScheduledChunk(decode, 1), ScheduledChunk(prompt, 40), ScheduledChunk(partial, 16), ScheduledChunk(generated_later, 20)]
    )
    assert forward_passes(plan) == [
        [Rows(decode, 24, 25, True), Rows(prompt, 0, 40, True), Rows(partial, 0, 16, False), Rows(generated_later, 0, 20, False)]
    ]


def test_generated_tokens_in_a_prefill_chunk_are_one_row_pieces_of_the_step_s_forward():
    decode = sequence("decode", 20, 5, 24)
    continued = sequence("continued", 10, 3, 0, first_block=10)  # prompt 0..9, generated 10..12
    preempted = sequence("preempted", 6, 4, 0, first_block=20)  # a partial chunk over 4 prompt tokens and 2 generated
    plan = StepPlan(scheduled=[ScheduledChunk(decode, 1), ScheduledChunk(continued, 13), ScheduledChunk(preempted, 8)])
    assert forward_passes(plan) == [
        [
            Rows(decode, 24, 25, True),
            Rows(continued, 0, 10, False),
            Rows(preempted, 0, 6, False),
            Rows(continued, 10, 11, False),
            Rows(continued, 11, 12, False),
            Rows(continued, 12, 13, True),
            Rows(preempted, 6, 7, False),
            Rows(preempted, 7, 8, False),
        ]
    ]
    generated_only = sequence("generated-only", 6, 4, 7, first_block=30)  # its prompt was computed by an earlier chunk
    plan = StepPlan(scheduled=[ScheduledChunk(generated_only, 3)])
    assert forward_passes(plan) == [[Rows(generated_only, p, p + 1, p == 9) for p in (7, 8, 9)]]
    assert forward_passes(StepPlan()) == []


def run_chunk(runner: Runner, seq: Sequence, num_new_tokens: int) -> int:
    plan = StepPlan(scheduled=[ScheduledChunk(seq, num_new_tokens)])
    token = runner.execute(plan).token_ids[seq.seq_id]
    seq.advance_computed(num_new_tokens)
    seq.append_token(token)
    return token


def kv_of(kv_cache: torch.Tensor, seq: Sequence, num_tokens: int) -> torch.Tensor:
    """(num_tokens, num_layers, 2, num_kv_heads, head_dim): the sequence's K and V, by position."""
    blocks = kv_cache[torch.tensor(seq.block_table)]  # (blocks, layers, 2, block_size, heads, dim)
    return blocks.permute(0, 3, 1, 2, 4, 5).flatten(0, 1)[:num_tokens]


CPU_BACKENDS = {"torch": paged_attention_torch, "cpp": paged_attention_cpu}


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=CPU_BACKENDS)
@pytest.mark.parametrize("num_generated", [1, 17, 40])
def test_a_recomputed_generated_token_gets_the_bits_its_decode_step_gave_it(num_generated, backend):
    """Tiny random model in bf16 on each CPU backend: prefill then decode one token at a time, versus
    the prompt and those tokens prefilled as one chunk on another cache and other blocks."""
    if backend == "cpp" and not cpu_extension.load():
        pytest.skip("the C++ CPU kernels do not build here")
    config = tiny_config(vocab_size=512, max_position_embeddings=1024)
    model = random_model(config, seed=0, attention=CPU_BACKENDS[backend], dtype=torch.bfloat16).eval()
    shape = KvCacheShape(64, config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim).as_tuple()
    prompt = [(7 * i) % 509 + 3 for i in range(37)]

    decoded_runner = Runner(model, torch.zeros(shape, dtype=torch.bfloat16), BLOCK_SIZE, Sampler())
    decoded = Sequence("decoded", prompt, SamplingOptions(max_tokens=1000, ignore_eos=True))
    decoded.append_blocks(range(10))
    decoded.admit()
    tokens = [run_chunk(decoded_runner, decoded, len(prompt))]
    while len(tokens) <= num_generated:
        tokens.append(run_chunk(decoded_runner, decoded, 1))

    replayed_runner = Runner(model, torch.zeros(shape, dtype=torch.bfloat16), BLOCK_SIZE, Sampler())
    replayed = Sequence("replayed", prompt, SamplingOptions(max_tokens=1000, ignore_eos=True))
    for token in tokens[:num_generated]:
        replayed.append_token(token)
    replayed.append_blocks(range(63, 53, -1))
    replayed.admit()
    next_token = run_chunk(replayed_runner, replayed, replayed.num_tokens)

    num_tokens = len(prompt) + num_generated
    assert torch.equal(kv_of(replayed_runner.kv_cache, replayed, num_tokens), kv_of(decoded_runner.kv_cache, decoded, num_tokens))
    assert next_token == tokens[num_generated]


# -- the embedded SmolLM2 in bf16: where greedy continuations drifted ~20-30 tokens after the cut --

NUM_TOKENS = 80


@pytest.fixture(scope="module")
def smollm2_bf16() -> LoadedModel:
    return load_model(None, torch.bfloat16, "cpu", select_attention("cpu"))


def tokens_of(engine: Engine, request: Request) -> list[int]:
    return [t for output in engine.generate([request])[request.request_id] for t in output.new_token_ids]


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("options", "cuts"),
    [(dict(), (14, 30, 50)), (dict(temperature=0.8, top_p=0.95, seed=1234), (14, 50))],
    ids=["greedy", "seeded"],
)
def test_a_bf16_reply_continued_on_a_fresh_engine_equals_the_uninterrupted_one(smollm2_bf16, options, cuts):
    prompt = tuple(smollm2_bf16.tokenizer.encode("The history of the city of Rome begins"))
    sampling = SamplingOptions(max_tokens=NUM_TOKENS, ignore_eos=True, **options)
    whole = tokens_of(Engine(smollm2_bf16, EngineConfig(num_kv_blocks=64)), Request("w", prompt, sampling))
    assert len(whole) == NUM_TOKENS
    for cut in cuts:
        request = Request(f"c{cut}", prompt, replace(sampling), generated_token_ids=tuple(whole[:cut]))
        continued = tokens_of(Engine(smollm2_bf16, EngineConfig(num_kv_blocks=64)), request)
        assert whole[:cut] + continued == whole, f"continued after {cut} tokens"


def test_a_long_replay_is_spread_over_steps_at_most_max_replayed_tokens_per_step_each(make_engine):
    engine = make_engine(num_blocks=64, max_num_batched_tokens=512, max_replayed_tokens_per_step=32)
    continued = Sequence("continued", range(3, 13), SamplingOptions(max_tokens=72, ignore_eos=True))
    for i in range(70):
        continued.append_token(100 + i)
    prompt = Sequence("prompt", range(3, 203), SamplingOptions(max_tokens=3, ignore_eos=True))
    engine.scheduler.add(continued)
    engine.scheduler.add(prompt)
    plans = engine.run_until_idle()
    chunks = [[(c.seq.seq_id, c.num_new_tokens) for c in plan.scheduled] for plan in plans]
    # 10 prompt tokens and 32 generated ones, 32 more, the last 6 (sampled); the other prompt is
    # not capped and decodes alongside.
    assert chunks[:4] == [
        [("continued", 42), ("prompt", 200)],
        [("prompt", 1), ("continued", 32)],
        [("prompt", 1), ("continued", 6)],
        [("continued", 1)],
    ]
    assert continued.num_output_tokens == 72
