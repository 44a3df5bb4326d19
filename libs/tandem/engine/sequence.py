"""One request inside the engine: its tokens, its KV blocks, how far its KV is computed.

The Sequence owns this data; the scheduler and the KV cache manager change it only through the
named methods below. There is no prefill or decode phase: a sequence has `num_tokens` tokens, of
which the first `num_computed_tokens` have their K and V in the cache, and every step brings the
computed count closer to the token count (a prefill chunk, a prefix-cache hit, or one decode).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llguidance import LLMatcher

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on the alternatives listed per token


class Lane(IntEnum):
    """Priority lane; lower value is served first."""

    PAID = 0
    FREE = 1
    BACKGROUND = 2


class FinishReason(str, Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    CANCELLED = "cancelled"  # aborted by the user or by nobody reading


class StopReason(str, Enum):
    """What ended a reply where its finish reason alone does not say (vLLM's `stop_reason`)."""

    REPETITION = "repetition"  # its output ended repeating one n-gram (engine/repetition.py); finish LENGTH


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off; keeps tokens at least min_p times as likely as the likeliest
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # matched on text by the engine, which passes the hits to Scheduler.update
    ignore_eos: bool = False
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are masked, stop strings unread (ReplyText), until this many tokens are out
    presence_penalty: float = 0.0  # OpenAI's, over the output so far; 0 = off
    frequency_penalty: float = 0.0  # OpenAI's, over the output so far; 0 = off
    repetition_penalty: float = 1.0  # vLLM's (HF's), over prompt and output; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # None: no logprobs; k: the sampled token's logprob and the k likeliest tokens' (engine/logprobs.py)
    top_logprobs: int | None = None
    grammar: str = ""  # structured output: a spec (tandem.structured_output) the reply must match; "" = free text

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 and finite (1 = off), got {self.repetition_penalty}")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise ValueError("each logit_bias must be in [-100, 100]")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class Sequence:
    """A request's token ids (prompt then output), block table and progress.

    Attributes are read freely (the runner builds its batch from them) but changed only
    through the methods, which keep the invariants:
    num_computed_tokens <= num_tokens, num_computed_tokens <= len(block_table) * block_size,
    len(block_hashes) <= len(block_table) and block_hashes[i] is the key of block_table[i].
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: Iterable[int],
        sampling: SamplingOptions = SamplingOptions(),
        *,
        lane: Lane = Lane.FREE,
        tenant: str = "",
        user_id: str = "",
        num_public_prefix_tokens: int = 0,
        eos_token_ids: Iterable[int] = (),
        is_prefill_only: bool = False,
        grammar: LLMatcher | None = None,
    ) -> None:
        """`grammar`: a fresh matcher of sampling.grammar's spec; every token appended advances it."""
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        if not 0 <= num_public_prefix_tokens <= self.num_prompt_tokens:
            raise ValueError(
                f"num_public_prefix_tokens must be in [0, {self.num_prompt_tokens}] (the prompt's length), got {num_public_prefix_tokens}"
            )
        self.sampling = sampling
        self.lane = lane
        self.tenant = tenant
        self.user_id = user_id  # within a lane, users are admitted round-robin
        self.num_public_prefix_tokens = num_public_prefix_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        # Prefill side of a handoff: once its first token is sampled the scheduler hands it off,
        # blocks and all, for the engine to export, instead of decoding it.
        self.is_prefill_only = is_prefill_only
        self.arrival_order = 0  # set by the scheduler when added; breaks ties in FIFO and preemption
        self.arrival_s = 0.0  # time.monotonic() when it arrived (at its worker, or when the scheduler took it)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: StopReason | None = None
        self.grammar = grammar

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, lane={self.lane.name}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def has_finished_grammar(self) -> bool:
        """Its grammar is complete (it took the end of sequence, or nothing more can follow) or
        was broken by a token it does not allow: either way the reply can go no further."""
        return self.grammar is not None and (self.grammar.is_stopped() or self.grammar.is_error())

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    # -- changed by the scheduler ---------------------------------------------------------------

    def mark_arrived(self, arrival_order: int, arrival_s: float = 0.0) -> None:
        self.arrival_order = arrival_order
        self.arrival_s = arrival_s

    def admit(self, num_cached_tokens: int | None = None) -> None:
        """Waiting -> running; the first admission fixes how much of the prompt was a cache hit.

        `num_cached_tokens` overrides it for a sequence prefilled elsewhere (the prefill
        worker's count), whose attached blocks are an import, not a hit.
        """
        if self.status is not SequenceStatus.WAITING:
            raise RuntimeError(f"{self.seq_id}: admit() from {self.status.name}")
        if num_cached_tokens is not None:
            self.num_cached_tokens = num_cached_tokens
        elif self.num_preemptions == 0:
            self.num_cached_tokens = min(self.num_computed_tokens, self.num_prompt_tokens)
        self.status = SequenceStatus.RUNNING

    def preempt(self) -> None:
        """Running -> waiting, to be recomputed from scratch; blocks must be released first."""
        if self.block_table:
            raise RuntimeError(f"{self.seq_id}: release its blocks before preempting it")
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def finish(self, reason: FinishReason, stop_reason: StopReason | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def advance_computed(self, num_new_tokens: int) -> None:
        """The K and V of the next `num_new_tokens` tokens are now in the cache."""
        num_computed = self.num_computed_tokens + num_new_tokens
        if num_new_tokens < 1 or num_computed > self.num_tokens:
            raise ValueError(f"{self.seq_id}: cannot compute {num_new_tokens} more of {self.num_uncomputed_tokens} tokens")
        self.num_computed_tokens = num_computed

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.consume_token(token_id)  # a refused token leaves it in error: has_finished_grammar

    # -- changed by the KV cache manager --------------------------------------------------------

    def attach_computed_blocks(self, block_ids: SequenceOf[int], block_hashes: SequenceOf[int], num_computed_tokens: int) -> None:
        """Start the block table with blocks whose KV is already there (prefix hit or import)."""
        if self.block_table:
            raise RuntimeError(f"{self.seq_id}: already has blocks")
        if len(block_hashes) > len(block_ids) or num_computed_tokens > self.num_tokens:
            raise ValueError(f"{self.seq_id}: {len(block_ids)} blocks, {len(block_hashes)} hashes, {num_computed_tokens} tokens")
        self.block_table = list(block_ids)
        self.block_hashes = list(block_hashes)
        self.num_computed_tokens = num_computed_tokens

    def append_blocks(self, block_ids: SequenceOf[int]) -> None:
        self.block_table.extend(block_ids)

    def append_block_hash(self, block_hash: int) -> None:
        if len(self.block_hashes) >= len(self.block_table):
            raise RuntimeError(f"{self.seq_id}: a hash for block {len(self.block_hashes)} it does not have")
        self.block_hashes.append(block_hash)

    def release_blocks(self) -> list[int]:
        """Hand back the block table; without blocks no token's KV is in the cache."""
        block_ids = self.block_table
        self.block_table = []
        self.block_hashes = []
        self.num_computed_tokens = 0
        return block_ids
