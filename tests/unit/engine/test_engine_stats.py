"""The plain numbers the engine keeps for a worker's metrics: sampled tokens, prefix-cache lookups
and hits (admissions and import reservations), KV blocks held by requests, and each request's
wait from arrival to its first admission and to its first token."""

from __future__ import annotations

import random
import time

import pytest
from reference_model import random_model, tiny_config
from test_engine import byte_level_tokenizer, greedy, seeded_prompts

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import Lane, SamplingOptions
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.loader import LoadedModel


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    config = tiny_config(vocab_size=512, max_position_embeddings=1024)
    model = random_model(config, seed=0, attention=paged_attention_reference)
    return LoadedModel(model=model.eval(), config=config, tokenizer=byte_level_tokenizer(config.vocab_size))


def test_generated_tokens_prefix_lookups_and_kv_usage_follow_the_requests(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    prompt = seeded_prompts(10)[8][:90]
    engine.add(greedy("first", prompt))
    engine.step()  # the whole prompt in one step: 6 blocks held, one token sampled
    held = engine.stats()
    assert held.scheduler.num_blocks == 64
    assert held.kv_cache_usage == pytest.approx(6 / 64)
    assert (held.num_generated_tokens, held.num_prefill_tokens) == (1, 90)
    assert (held.scheduler.num_prefix_query_tokens, held.scheduler.num_prefix_hit_tokens) == (90, 0)
    while engine.has_work():
        engine.step()
    done = engine.stats()
    assert done.num_generated_tokens == 12
    assert done.kv_cache_usage == 0.0, "blocks only the prefix cache keeps are free"
    assert done.scheduler.num_cached_blocks > 0
    assert done.kv_cache_prefix_cached == pytest.approx(done.scheduler.num_cached_blocks / 64), "and they stay cached"

    engine.generate([greedy("again", prompt)])
    again = engine.stats()
    assert again.scheduler.num_prefix_query_tokens == 180
    assert again.scheduler.num_prefix_hit_tokens == 80  # five full blocks; the sixth holds the last token
    assert again.num_generated_tokens == 24


def test_each_request_reports_its_queue_wait_and_time_to_first_token_once_in_its_lane(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64, max_num_seqs=1))
    engine.add(Request("paid", (5, 6, 7), SamplingOptions(max_tokens=3), lane=Lane.PAID))
    engine.add(Request("free", (8, 9, 10), SamplingOptions(max_tokens=3), lane=Lane.FREE))
    engine.step()
    first, first_token = engine.drain_queue_waits()  # admitted, prefilled and sampled in one step
    assert (first.lane, first.until, first_token.lane, first_token.until) == (Lane.PAID, "admitted", Lane.PAID, "first_token")
    assert 0 <= first.wait_s <= first_token.wait_s, "its first token came after its admission, in the same step"
    assert engine.drain_queue_waits() == [], "drained once"
    while engine.has_work():
        engine.step()
    second, second_token = engine.drain_queue_waits()  # nothing for the paid one's later tokens
    assert (second.lane, second.until, second_token.until) == (Lane.FREE, "admitted", "first_token")
    assert second.wait_s > first.wait_s, "it waited for the paid one's seat"
    assert second_token.wait_s > first_token.wait_s


def test_a_request_that_arrived_earlier_at_its_worker_counts_its_wait_from_then(tiny):
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    arrived_s = time.monotonic() - 0.5  # it reached the worker while a step was in flight
    engine.add(Request("paid", (5, 6, 7), SamplingOptions(max_tokens=2), lane=Lane.PAID, arrival_s=arrived_s))
    engine.step()
    admitted, first_token = engine.drain_queue_waits()
    assert 0.5 <= admitted.wait_s <= first_token.wait_s <= time.monotonic() - arrived_s


def test_an_import_reservation_counts_as_a_prefix_lookup_with_its_cached_blocks_as_hits(tiny):
    history = seeded_prompts(10)[9][:64]
    decode = Engine(tiny, EngineConfig(num_kv_blocks=64))
    decode.generate([Request("earlier", tuple(history), SamplingOptions(max_tokens=1))])
    before = decode.stats().scheduler
    reservation = decode.reserve_import(greedy("r", history + [5] * 40), 7)
    after = decode.stats()
    assert after.scheduler.num_prefix_query_tokens - before.num_prefix_query_tokens == 104
    assert after.scheduler.num_prefix_hit_tokens - before.num_prefix_hit_tokens == 64
    assert after.kv_cache_usage == pytest.approx(7 / 64), "reserved blocks are held"
    decode.cancel_import(reservation)


def test_a_step_that_replays_generated_tokens_leaves_the_prefill_rate_as_it_was(tiny):
    """A continuation's generated tokens are recomputed one forward each: that step's time is no
    measure of what a prompt's prefill costs."""
    engine = Engine(tiny, EngineConfig(num_kv_blocks=64))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(200)] for _ in range(4)]  # large steps: over a quarter of the budget
    engine.generate([greedy("warm-up", prompts[0])])  # the first prefill step is not measured
    engine.generate([greedy("measured", prompts[1])])
    rate = engine.stats().prefill_tokens_per_s
    assert rate > 0
    continued = Request("continued", tuple(prompts[2][:150]), SamplingOptions(max_tokens=40), generated_token_ids=tuple(prompts[3][:30]))
    engine.add(continued)
    engine.step()  # the prompt and 30 replayed tokens: 180 rows
    budget = engine.scheduler.config.max_num_batched_tokens
    assert engine.stats().prefill_tokens_per_s == pytest.approx(rate * (budget - 1) / budget), "one decode runs now: its row"
