"""The load `tandem bench serve` sends: seeded arrival times (Poisson by default), length
spreads within their bounds, prompts of the asked length, and the built-in chat set."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from tandem.ops.chat_prompts import chat_set
from tandem.ops.workload import arrival_offsets_s, chat_requests, random_requests, spread_lengths


def test_the_same_seed_gives_the_same_arrivals_and_another_seed_others():
    first = arrival_offsets_s(50, request_rate=4.0, seed=7)
    assert first == arrival_offsets_s(50, request_rate=4.0, seed=7)
    assert first != arrival_offsets_s(50, request_rate=4.0, seed=8)


def test_arrivals_start_at_zero_rise_and_average_one_over_the_rate():
    offsets = arrival_offsets_s(4000, request_rate=5.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0.0 and all(gap > 0 for gap in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)
    # Exponential gaps (Poisson arrivals): the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.1)


def test_higher_burstiness_gives_steadier_gaps_with_the_same_mean():
    offsets = arrival_offsets_s(4000, request_rate=5.0, seed=1, burstiness=4.0)
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(0.1, rel=0.1)  # gamma(k=4): sd = mean / 2


def test_an_infinite_rate_sends_everything_at_once():
    assert arrival_offsets_s(5, request_rate=math.inf, seed=0) == [0.0] * 5


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_a_rate_that_is_not_positive_is_refused(rate):
    with pytest.raises(ValueError, match="request rate"):
        arrival_offsets_s(3, request_rate=rate, seed=0)


def test_lengths_spread_uniformly_within_the_range_ratio():
    lengths = spread_lengths(random.Random(0), 100, 0.25, 2000)
    assert min(lengths) == 75 and max(lengths) == 125
    assert spread_lengths(random.Random(0), 100, 0.0, 10) == [100] * 10
    with pytest.raises(ValueError, match="range ratio"):
        spread_lengths(random.Random(0), 100, 1.0, 1)


def test_random_prompts_have_the_asked_number_of_words_and_max_tokens():
    requests = random_requests(20, input_len=64, output_len=32, range_ratio=0.5, seed=3)
    assert requests == random_requests(20, input_len=64, output_len=32, range_ratio=0.5, seed=3)
    for request in requests:
        (message,) = request.messages
        assert message["role"] == "user" and 32 <= len(message["content"].split()) <= 96
        assert 16 <= request.max_tokens <= 48
    assert len({r.messages[0]["content"] for r in requests}) == 20


def test_chat_requests_come_from_the_built_in_set_and_vary():
    conversations = [tuple(c) for c in chat_set()]
    assert len(conversations) >= 30 and all(c[-1]["role"] == "user" for c in conversations)
    requests = chat_requests(40, output_len=64, range_ratio=0.0, seed=5)
    assert all(r.messages in conversations and r.max_tokens == 64 for r in requests)
    assert len({r.messages[-1]["content"] for r in requests}) > 15
    lengths = sorted(sum(len(m["content"]) for m in c) for c in conversations)
    assert lengths[-1] > 10 * lengths[0]  # short questions and long ones


def test_the_chat_api_sends_the_last_user_message():
    (request,) = [r for r in chat_requests(200, 8, 0.0, seed=0) if len(r.messages) == 3][:1]
    assert request.last_user_text == request.messages[-1]["content"]
