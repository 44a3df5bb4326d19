"""The requests a worker has posted to its engine that the engine's latest stats may not include
yet, and from them and those stats, what goes before a request offered now (admission.QueueState).
The engine reports its stats after a change with the number of calls (tickets) they include; a
posted request is forgotten once they include it, so it is counted once, never twice or not at all."""

from __future__ import annotations

from tandem.engine.engine import EngineConfig, EngineStats, Request
from tandem.engine.sequence import Lane
from tandem.worker.admission import QueueState


def num_prefill_tokens(request: Request) -> int:
    """The tokens a request's prefill computes (a continuation's generated ones too)."""
    return len(request.prompt_token_ids) + len(request.generated_token_ids)


class PostedWork:
    def __init__(self) -> None:
        self._posted: dict[int, tuple[Lane, int]] = {}  # by ticket: (lane, tokens to compute)

    def note(self, ticket: int, request: Request) -> None:
        """`request` was posted to the engine as call number `ticket`."""
        self._posted[ticket] = (request.lane, num_prefill_tokens(request))

    def queue_state(self, stats: EngineStats, num_applied: int, config: EngineConfig) -> QueueState:
        """The engine's `stats` (which include the first `num_applied` tickets) plus the requests
        posted since."""
        for ticket in [t for t in self._posted if t <= num_applied]:
            del self._posted[ticket]
        s = stats.scheduler
        waiting = dict(s.num_waiting_prefill_tokens)
        waiting_seqs = dict(s.num_waiting)
        for lane, num_tokens in self._posted.values():
            waiting[lane] += num_tokens
            waiting_seqs[lane] += 1
        return QueueState(
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            waiting_prefill_tokens=waiting,
            running_prefill_tokens=s.num_running_prefill_tokens,
            num_free_blocks=max(0, s.num_free_blocks - config.num_reserved_blocks),
            running_blocks=s.num_running_blocks,
            block_size=config.block_size,
            has_idle_capacity=s.has_idle_capacity and not any(lane < Lane.BACKGROUND for lane, _ in self._posted.values()),
            waiting_seqs=waiting_seqs,
            admissions_per_s=stats.admissions_per_s,
        )
