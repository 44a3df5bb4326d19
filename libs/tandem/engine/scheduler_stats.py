"""What the scheduler reports: a snapshot of its queues and KV blocks, and each sequence's wait
from its arrival to its admission and to its first token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.engine.sequence import Lane


@dataclass(frozen=True)
class QueueWait:
    """How long a sequence waited from its arrival until it was first admitted, or (`until`
    "first_token") until its first token was sampled."""

    lane: Lane
    wait_s: float
    until: Literal["admitted", "first_token"] = "admitted"


# Queue waits kept until drained (a worker drains them after every step); older ones are dropped.
MAX_QUEUE_WAITS = 4096


@dataclass(frozen=True)
class SchedulerStats:
    num_running: dict[Lane, int]
    num_waiting: dict[Lane, int]
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    num_prefix_hit_tokens: int  # total since start, recomputes included
    num_preemptions: int  # total since start
    num_queued_prefill_tokens: int  # tokens still to prefill: waiting sequences' and running prefills'
    num_waiting_prefill_tokens: dict[Lane, int]  # waiting sequences' tokens to compute, by lane
    # running prefills' tokens still to compute, by lane: they go before any admission (unpaid
    # ones compute nothing while paid work waits)
    num_running_prefill_tokens: dict[Lane, int]
    num_running_blocks: dict[Lane, int]  # KV blocks in running sequences' tables, by lane
    has_idle_capacity: bool  # background work would be admitted now
    num_blocks: int = 0  # the KV pool's blocks, reserved ones included
    num_prefix_query_tokens: int = 0  # tokens looked up in the prefix cache since start (admissions, imports)
