"""What `tandem bench serve` sends and when: the requests (random prompts of a length
distribution, or the built-in chat set) and their arrival times, all from one seed so two runs
against two servers send the same load."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tandem.ops.chat_prompts import chat_set

# Short, common English words: most tokenizers spend one token on each (with its space), so a
# prompt of N of them is about N tokens on any server. The server's usage gives the real count.
_WORD_TEXT = (
    "the of and to in is it that was for on are with as be at by this had not but from or have an "
    "they which one you were all we her she there would their will when who him been has more if no "
    "out so said what up its about than into them can only other new some could time these two may "
    "first then do any like my now over such our man me even most made after also did many off before "
    "must well back through years much where your way down should because long each just state people "
    "high day too little world very still own see men work last here both life being under never year"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    """One request of a run: the chat messages and the most tokens it may generate."""

    messages: tuple[dict[str, str], ...]
    max_tokens: int

    @property
    def last_user_text(self) -> str:
        """What Tandem's chat API sends (one new message per request)."""
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")


def spread_lengths(rng: random.Random, mean: int, range_ratio: float, num: int) -> list[int]:
    """`num` lengths uniform in [mean * (1 - range_ratio), mean * (1 + range_ratio)], at least 1."""
    if mean < 1:
        raise ValueError(f"a length must be at least 1, not {mean}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), not {range_ratio}")
    low, high = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(num)]


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    """Prompts of about `input_len` tokens (random common words), each asking for `output_len`."""
    rng = random.Random(seed)
    input_lens = spread_lengths(rng, input_len, range_ratio, num)
    output_lens = spread_lengths(rng, output_len, range_ratio, num)
    return [
        BenchRequest(({"role": "user", "content": " ".join(rng.choices(_WORDS, k=num_words))},), max_tokens)
        for num_words, max_tokens in zip(input_lens, output_lens, strict=True)
    ]


def chat_requests(num: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    """`num` conversations drawn from the built-in chat set, each asking for up to `output_len`."""
    rng = random.Random(seed)
    conversations = chat_set()
    output_lens = spread_lengths(rng, output_len, range_ratio, num)
    return [BenchRequest(tuple(rng.choice(conversations)), max_tokens) for max_tokens in output_lens]


def arrival_offsets_s(num: int, request_rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """When each request is sent, in seconds from the start: gaps drawn from a gamma distribution
    with mean 1 / rate (burstiness 1: exponential, a Poisson process; lower: burstier, higher:
    steadier). An infinite rate sends everything at once."""
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"request rate must be > 0 (or inf), not {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, not {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, now_s = [], 0.0
    for _ in range(num):
        offsets.append(now_s)
        now_s += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return offsets
