"""A paid request arriving during a step of free work cuts that step short (Engine.cut_step): the
step ends between layers with no result, the next step is the paid request's, and every reply's
tokens are the reference's, as the cut step's half-written KV is written again before it is read."""

from __future__ import annotations

import threading

import pytest
from reference_model import random_model, reference_greedy, tiny_config
from test_engine import NUM_NEW_TOKENS, byte_level_tokenizer, greedy, seeded_prompts

from tandem.engine.engine import DEFAULT_UNPAID_TOKENS, Engine, EngineConfig, Request
from tandem.engine.sequence import Lane, SamplingOptions
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.loader import LoadedModel


class Arrivals:
    """Attention that, once armed, calls a callback (a paid arrival's cut_step, from another
    thread as a worker's socket reader would) in the middle of the next forward."""

    def __init__(self) -> None:
        self.on_layer: list = []

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.on_layer:
            callback = self.on_layer.pop()
            arrival = threading.Thread(target=callback)
            arrival.start()
            arrival.join()
        return paged_attention_reference(*args, **kwargs)


@pytest.fixture(scope="module")
def model_and_arrivals() -> tuple[LoadedModel, Arrivals]:
    config = tiny_config(vocab_size=512, max_position_embeddings=1024)
    arrivals = Arrivals()
    model = random_model(config, seed=0, attention=arrivals)
    return LoadedModel(model=model.eval(), config=config, tokenizer=byte_level_tokenizer(config.vocab_size)), arrivals


def paid(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, tuple(prompt), SamplingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True), lane=Lane.PAID)


def test_a_paid_arrival_cuts_a_step_of_free_work_and_every_reply_is_the_references(model_and_arrivals):
    loaded, arrivals = model_and_arrivals
    prompts = seeded_prompts(12)
    free_prompts, paid_prompt = [prompts[9], prompts[8]], prompts[7]  # 150 and 100 tokens, then 64
    engine = Engine(loaded, EngineConfig(num_kv_blocks=200, max_num_batched_tokens=64, max_num_unpaid_tokens=8))
    for i, prompt in enumerate(free_prompts):
        engine.add(greedy(f"free-{i}", prompt))
    outputs = engine.step() + engine.step()  # free chunks of the whole budget: nothing paid runs, so no unpaid cap
    assert outputs == [] and engine.stats().num_steps == 2

    arrivals.on_layer.append(engine.cut_step)  # the paid request reaches the worker during the next step
    before = engine.stats()
    assert engine.step() == [], "cut: nothing computed, nothing sampled"
    cut = engine.stats()
    assert (cut.num_cut_steps, cut.num_steps) == (1, before.num_steps), "a cut step is not a step"
    assert cut.num_prefill_tokens == before.num_prefill_tokens

    engine.add(paid("paid", paid_prompt))  # applied after the cut step, as the engine's loop does
    first = engine.step()
    assert [o.request_id for o in first] == ["paid"], "the next step is the paid request's: its prompt whole, no free rows"
    assert engine.stats().num_prefill_tokens - cut.num_prefill_tokens == len(paid_prompt)
    streams: dict[str, list[int]] = {"paid": list(first[0].new_token_ids)}
    while engine.has_work():
        for output in engine.step():
            streams.setdefault(output.request_id, []).extend(output.new_token_ids)
    for request_id, prompt in [("free-0", free_prompts[0]), ("free-1", free_prompts[1]), ("paid", paid_prompt)]:
        assert streams[request_id] == reference_greedy(loaded.model, prompt, NUM_NEW_TOKENS), request_id


def test_a_step_of_paid_work_only_is_never_cut(model_and_arrivals):
    loaded, arrivals = model_and_arrivals
    engine = Engine(loaded, EngineConfig(num_kv_blocks=200, max_num_unpaid_tokens=8))
    engine.add(paid("paid-1", seeded_prompts(12)[9]))
    arrivals.on_layer.append(engine.cut_step)
    (output,) = engine.step()  # paid rows only: the arrival waits for it to end
    assert output.request_id == "paid-1" and engine.stats().num_cut_steps == 0
    arrivals.on_layer.clear()


def test_an_engine_configured_not_to_cut_finishes_its_step(model_and_arrivals):
    loaded, arrivals = model_and_arrivals
    engine = Engine(loaded, EngineConfig(num_kv_blocks=200, max_num_unpaid_tokens=8, cut_unpaid_steps=False))
    engine.add(greedy("free", seeded_prompts(12)[9]))
    arrivals.on_layer.append(engine.cut_step)
    engine.step()
    assert engine.stats().num_cut_steps == 0 and engine.stats().num_steps == 1
    arrivals.on_layer.clear()


def test_an_engine_on_a_cpu_caps_unpaid_rows_beside_paid_work_unless_configured(model_and_arrivals):
    loaded, _ = model_and_arrivals
    assert Engine(loaded, EngineConfig(num_kv_blocks=8)).scheduler.config.max_num_unpaid_tokens == DEFAULT_UNPAID_TOKENS["cpu"]
    assert Engine(loaded, EngineConfig(num_kv_blocks=8, max_num_unpaid_tokens=32)).scheduler.config.max_num_unpaid_tokens == 32
