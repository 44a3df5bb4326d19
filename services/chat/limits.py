"""The bounds every request schema shares, as annotated types. A value outside them is refused
by validation (400 naming the parameter) before anything is stored or sent, never later by the
protobuf it would not fit (tandem.v1.SamplingParams: seed uint64, max_tokens and top_k and
stop_token_ids uint32, temperature/top_p/min_p float)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from tandem.engine.sequence import MAX_TOP_LOGPROBS

MAX_TOKENS_LIMIT = 1 << 20  # more than any context window served; a reply is capped to the room left anyway
MAX_MESSAGES = 1000  # OpenAI messages in one request (the body limit bounds their size)
MAX_CONTENT_PARTS = 100  # text parts of one OpenAI message
MAX_TOOLS = 128  # OpenAI's limit on `tools` (and the calls one message may carry back)
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 200
MAX_STOP_TOKEN_IDS = 64
MAX_MODEL_NAME_CHARS = 200
MAX_LOGIT_BIAS = 300  # token ids one request may bias
# Choices (`n`) one OpenAI request may ask for. Each is a whole reply: a sequence in a worker's
# batch and a worst case in the user's quota; 8 keeps one request from taking a batch's worth of
# a worker, and is more than the clients we know of ask for (best-of-a-few samples).
MAX_CHOICES = 8

Seed = Annotated[int, Field(ge=0, lt=2**64)]
NumChoices = Annotated[int, Field(strict=True, ge=1, le=MAX_CHOICES)]  # strict: `true` is not 1
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
TokenId = Annotated[int, Field(ge=0, lt=2**32)]
Penalty = Annotated[float, Field(ge=-2, le=2)]  # OpenAI's presence and frequency penalties
# vLLM's repetition penalty: any positive factor; the bound only keeps it a finite float32.
RepetitionPenalty = Annotated[float, Field(gt=0, le=1e6)]
LogitBias = Annotated[float, Field(ge=-100, le=100)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]  # alternatives listed per token
ModelName = Annotated[str, Field(max_length=MAX_MODEL_NAME_CHARS)]
# Query and header integers (a paging cursor in unix ms, an SSE event id) stay below this: what a
# signed 64-bit column or a Redis stream id holds.
INT64_LIMIT = 2**63


def check_stop_strings(stops: list[str]) -> list[str]:
    """At most MAX_STOP_STRINGS, each at most MAX_STOP_CHARS characters (a ValueError for validation)."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(stops)} stop strings; at most {MAX_STOP_STRINGS} are accepted")
    too_long = next((s for s in stops if len(s) > MAX_STOP_CHARS), None)
    if too_long is not None:
        raise ValueError(f"a stop string of {len(too_long)} characters; each may have at most {MAX_STOP_CHARS}")
    return stops
