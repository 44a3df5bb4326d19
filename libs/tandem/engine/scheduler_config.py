"""The scheduler's configuration: a step's token budget, its seats, the KV reserve, the context
window, and the limits that keep paid work's steps short."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.repetition import RepetitionStop


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # tokens computed per step, decodes and prefill chunks together
    # Tokens a step computes when no running sequence decodes (prompts alone: no reply's next token
    # waits on the step, so a longer one delays no one's stream); None: max_num_batched_tokens.
    max_num_prefill_only_tokens: int | None = None
    max_num_seqs: int = 256  # running sequences at once
    num_reserved_blocks: int = 4  # admissions leave this many blocks free for running sequences to grow
    max_model_len: int | None = None  # context window in tokens; None = only the KV pool limits it
    # Generated tokens a prefill chunk recomputes (a continuation's, a preempted sequence's) are
    # computed as decodes, each attending over its whole context (tandem.engine.runner); at most
    # this many per sequence per step, so a long replay does not stall the step's other sequences.
    max_replayed_tokens_per_step: int = 32
    # Background work is admitted only while this share of the usable blocks (above the reserve) is free.
    background_min_free_fraction: float = 0.5
    # Tokens a step computes for free and background sequences together (decodes and chunks)
    # while paid work runs; None: only max_num_batched_tokens bounds them.
    max_num_unpaid_tokens: int | None = None
    # Ends a reply whose output repeats one n-gram over and over (repetition.py); None: off.
    repetition_stop: RepetitionStop | None = None

    def step_tokens(self, has_decodes: bool) -> int:
        """The tokens a step computes: max_num_batched_tokens, or with no decodes among its running
        sequences, max_num_prefill_only_tokens where set."""
        if has_decodes or self.max_num_prefill_only_tokens is None:
            return self.max_num_batched_tokens
        return self.max_num_prefill_only_tokens

    def __post_init__(self) -> None:
        if (
            self.max_num_batched_tokens < 1
            or self.max_num_seqs < 1
            or self.num_reserved_blocks < 0
            or self.max_replayed_tokens_per_step < 1
            or not 0.0 <= self.background_min_free_fraction <= 1.0
            or (self.max_num_unpaid_tokens is not None and self.max_num_unpaid_tokens < 1)
            or (self.max_num_prefill_only_tokens is not None and self.max_num_prefill_only_tokens < 1)
        ):
            raise ValueError(f"invalid scheduler config: {self}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
