"""Queues bounded by time: a worker refuses a request it could not start within its lane's TTFT
target, so the router tries another worker (or tells the user at the door, with a time to retry)
instead of letting it wait behind everyone.

The wait of a request offered now is the longer of two estimates, each from what this worker
measured:
- the prefill work that goes before it, at its prefill rate: the running prefills' remaining
  tokens (they take the step's budget before any admission; for a paid request only the paid
  ones, since while paid work waits a step computes no unpaid rows), plus the waiting tokens of
  its own lane and of every lane served before it (paid work counts for everyone, free work for
  free and background requests);
- the requests queued before it (the same lanes), at the rate its lane's queue drains
  (tandem.engine.admission_rate): when running replies hold the KV blocks or a step's rows,
  a queued request waits for them to end, however short its prompt.
Background work is taken only on idle capacity (nothing paid or free waits, KV blocks plentiful).

Free KV blocks are reported (`can_hold`, the heartbeat's kv_blocks_free) but are no reason to
refuse a paid or free request: blocks come back within seconds as running replies end, and
refusing whenever the queued prompts outgrow the free blocks refused short queues that start well
within their targets (a few long prompts on a small CPU worker). A queue that cannot
start in time shows in the wait; sustained KV pressure is the router's ladder's to act on.

Until the worker has measured either rate it does not refuse on wait: it has nothing to
estimate from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tandem.config import Settings
from tandem.engine.sequence import Lane

QUEUE_FULL = "queue_full"  # the refusal's reason: the router tries another worker
MIN_RETRY_AFTER_S = 0.5  # a refusal never asks for a retry sooner than this


@dataclass(frozen=True)
class TtftTargets:
    """How long a request of each lane may wait before it starts computing."""

    paid_s: float
    free_s: float

    @classmethod
    def from_settings(cls, settings: Settings, device: str) -> TtftTargets:
        """The settings' targets, times cpu_ttft_scale when the engine runs on a CPU."""
        scale = settings.cpu_ttft_scale if torch.device(device).type == "cpu" else 1.0
        return cls(settings.ttft_target_paid_s * scale, settings.ttft_target_free_s * scale)

    def for_lane(self, lane: Lane) -> float | None:
        """None for background work, which has no target: it runs only on idle capacity."""
        return {Lane.PAID: self.paid_s, Lane.FREE: self.free_s}.get(lane)


@dataclass(frozen=True)
class QueueState:
    """What an engine must do before a request offered now starts computing."""

    prefill_tokens_per_s: float  # measured recently; 0 = not yet
    waiting_prefill_tokens: Mapping[Lane, int]  # queued (in the engine or on their way to it), by lane
    running_prefill_tokens: Mapping[Lane, int]  # running prefills' tokens still to compute, by lane
    num_free_blocks: int  # free KV blocks above the reserve (cached ones included: they can be evicted)
    running_blocks: Mapping[Lane, int]  # KV blocks held by running sequences, by lane
    block_size: int
    has_idle_capacity: bool  # nothing paid or free waits and KV blocks are plentiful
    waiting_seqs: Mapping[Lane, int] = field(default_factory=dict)  # queued requests (as waiting_prefill_tokens), by lane
    admissions_per_s: Mapping[Lane, float] = field(default_factory=dict)  # how fast each lane's queue drains, once measured

    def prefill_tokens_ahead(self, lane: Lane) -> int:
        """Prefill tokens computed before a request of `lane` offered now: running prefills (for a
        paid request only paid ones: while paid work waits, a step computes no unpaid rows) and
        the waiting ones of its lane and the lanes served before it."""
        running = sum(n for running_lane, n in self.running_prefill_tokens.items() if lane is not Lane.PAID or running_lane is Lane.PAID)
        return running + sum(n for queued_lane, n in self.waiting_prefill_tokens.items() if queued_lane <= lane)

    def seqs_ahead(self, lane: Lane) -> int:
        """Queued requests admitted before a request of `lane` offered now."""
        return sum(n for queued_lane, n in self.waiting_seqs.items() if queued_lane <= lane)

    def estimated_wait_s(self, lane: Lane) -> float | None:
        """Seconds before a request of `lane` offered now starts computing: the longer of the
        prefill work ahead at the prefill rate and the requests ahead at its lane's admission
        rate; None until either rate is measured."""
        waits = []
        if self.prefill_tokens_per_s > 0.0:
            waits.append(self.prefill_tokens_ahead(lane) / self.prefill_tokens_per_s)
        if lane in self.admissions_per_s:
            waits.append(self.seqs_ahead(lane) / self.admissions_per_s[lane])
        return max(waits, default=None)

    def can_hold(self, lane: Lane, num_tokens: int) -> bool:
        """The KV can take the request's tokens after the waiting work ahead of it, counting the
        blocks of running lower-lane sequences, which give way to it."""
        num_blocks_ahead = sum(-(-n // self.block_size) for queued_lane, n in self.waiting_prefill_tokens.items() if queued_lane <= lane)
        num_yielding = sum(n for running_lane, n in self.running_blocks.items() if running_lane > lane)
        return num_blocks_ahead + -(-num_tokens // self.block_size) <= self.num_free_blocks + num_yielding

    @property
    def is_empty(self) -> bool:
        """Nothing runs or waits: any request the engine can run at all starts at once."""
        return not (
            any(self.running_prefill_tokens.values()) or any(self.waiting_prefill_tokens.values()) or any(self.running_blocks.values())
        )


@dataclass(frozen=True)
class Overloaded:
    """Why this worker refuses a request now, and in how many seconds it expects to take one."""

    message: str
    retry_after_s: float


def queue_verdict(state: QueueState, lane: Lane, num_tokens: int, targets: TtftTargets) -> Overloaded | None:
    """Overloaded when a request of `lane` with `num_tokens` tokens to compute, offered now, would
    wait longer than its lane's target, or is background work on a worker that is not idle or
    whose free blocks cannot take it; None when this worker takes it.

    retry_after_s: the seconds until the work ahead has shrunk to the target at the measured rate
    (the estimate minus the target); for background work, the estimated wait of the work ahead
    of it; never less than MIN_RETRY_AFTER_S.
    """
    wait_s = state.estimated_wait_s(lane)
    target_s = targets.for_lane(lane)
    if target_s is None:
        if not state.has_idle_capacity:
            return Overloaded("this worker is busy; background work runs only on idle capacity", _retry_after(wait_s or 0.0))
        if not state.is_empty and not state.can_hold(lane, num_tokens):
            return Overloaded("this worker's free KV blocks cannot take this background request now", _retry_after(wait_s or 0.0))
        return None
    if wait_s is not None and wait_s > target_s:
        return Overloaded(
            f"a {lane.name.lower()} request would wait about {wait_s:.1f} s to start here "
            f"({state.prefill_tokens_ahead(lane)} prefill tokens ahead at {state.prefill_tokens_per_s:.0f} tokens/s, "
            f"{state.seqs_ahead(lane)} requests ahead, {lane.name.lower()} ones admitted at {state.admissions_per_s.get(lane, 0.0):.1f}/s); "
            f"the target is {target_s:.1f} s",
            _retry_after(wait_s - target_s),
        )
    return None


def _retry_after(seconds: float) -> float:
    return max(MIN_RETRY_AFTER_S, seconds)
