"""The typed plan one scheduler step hands to the runner, and what the scheduler's update of
the step's results took out of scheduling."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.sequence import Lane, Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_new_tokens` tokens of `seq` to compute this step, right after its computed ones.

    The positions are fixed when the chunk is planned: the new tokens are
    seq.token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens], and the
    sequence's context after the step is `num_context_tokens` long. Only a chunk that reaches
    the end of the sequence's tokens is sampled; a prefill that is not complete gets no token.
    """

    seq: Sequence
    num_new_tokens: int
    num_computed_tokens: int = field(init=False)
    is_sampled: bool = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.num_new_tokens <= self.seq.num_uncomputed_tokens:
            raise ValueError(f"{self.seq.seq_id}: a chunk of {self.num_new_tokens} of {self.seq.num_uncomputed_tokens} uncomputed tokens")
        object.__setattr__(self, "num_computed_tokens", self.seq.num_computed_tokens)
        object.__setattr__(self, "is_sampled", self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens)

    @property
    def num_context_tokens(self) -> int:
        return self.num_computed_tokens + self.num_new_tokens

    @property
    def new_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.num_computed_tokens : self.num_context_tokens]


@dataclass
class StepPlan:
    """One step's work: decodes first, then prefill chunks; what was preempted or aborted; and
    which sequences the runner can forget (their per-sequence state, e.g. a seeded generator)."""

    scheduled: list[ScheduledChunk] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_unpaid_tokens: int = 0  # of both, those of free and background sequences
    # Sequences taken from the waiting queues, by lane (recomputes of preempted ones included).
    num_admitted: dict[Lane, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    aborted: list[Sequence] = field(default_factory=list)
    # Every sequence that left scheduling since the previous plan (finished, aborted or handed
    # off); the runner forgets them before it runs this plan, as vLLM v1's finished_req_ids.
    finished_seq_ids: list[str] = field(default_factory=list)

    def add_chunk(self, seq: Sequence, num_new_tokens: int, *, is_decode: bool) -> None:
        """Schedule `num_new_tokens` of `seq`, counted as decode or prefill tokens and, for a
        free or background sequence, as unpaid ones."""
        self.scheduled.append(ScheduledChunk(seq, num_new_tokens))
        if seq.lane is not Lane.PAID:
            self.num_unpaid_tokens += num_new_tokens
        if is_decode:
            self.num_decode_tokens += num_new_tokens
        else:
            self.num_prefill_tokens += num_new_tokens

    def withdraw(self, seq: Sequence) -> None:
        """Take back the chunk `seq` got in this plan, if any."""
        for i, chunk in enumerate(self.scheduled):
            if chunk.seq is seq:
                del self.scheduled[i]
                if seq.lane is not Lane.PAID:
                    self.num_unpaid_tokens -= chunk.num_new_tokens
                if seq.num_uncomputed_tokens == 1:  # as add_chunk counted it: a decode
                    self.num_decode_tokens -= chunk.num_new_tokens
                else:
                    self.num_prefill_tokens -= chunk.num_new_tokens
                return

    @property
    def num_replayed_tokens(self) -> int:
        """Generated tokens that prefill chunks recompute: the runner computes each as a decode
        (tandem.engine.runner.forward_passes)."""
        return sum(
            max(0, chunk.num_context_tokens - max(chunk.num_computed_tokens, chunk.seq.num_prompt_tokens))
            for chunk in self.scheduled
            if chunk.num_new_tokens > 1
        )

    @property
    def sampled_seqs(self) -> list[Sequence]:
        """The sequences that get a token from this step, in chunk order."""
        return [chunk.seq for chunk in self.scheduled if chunk.is_sampled]


@dataclass(frozen=True)
class UpdateResult:
    """What applying a step's results took out of scheduling."""

    finished: list[Sequence]  # their blocks are freed
    handed_off: list[Sequence]  # prefill-only, first token sampled: their blocks are kept for export
