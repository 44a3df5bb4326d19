"""Continuous batching: each step's work under a token budget, and the results applied after it.

    plan = scheduler.schedule()                            # who computes how many tokens this step
    sampled = runner.execute(plan).token_ids              # {seq_id: token} for plan.sampled_seqs
    result = scheduler.update(plan, sampled, stopped_ids)  # what finished, what was handed off

`stopped_ids` are the sequences whose text hit a stop string (the engine detokenizes). update
finishes those and every sequence its new token ends, and hands off each prefill-only sequence
once its first token is sampled, keeping its blocks for the engine to export. Each plan names
the sequences that left since the previous one (finished, handed off, and the aborts it applies
itself), so the runner drops their state before it runs the plan.

There is no prefill phase or decode phase: every sequence's computed-token count catches up to
its token count, one chunk per step, which covers chunked prefill, prefix hits and decoding in
one rule. A step takes, in order: every running decode (one token each), the next chunk of
running prefills (each in lane order, oldest first within a lane), then admissions from the
waiting queues by lane (paid, free, background; round-robin by user within a lane,
lane_queue.py) while KV blocks last above the reserve. A step with no running decode may take
more tokens (max_num_prefill_only_tokens): no stream waits on it.

Paid work goes first in every step: while a paid sequence waits, free and background sequences
compute nothing (the step is the paid admission's, plus paid decodes), and running decodes and
prefills take the budget in lane order. (Leaving the paid decodes out of that step too made
paid replies slower under paid load: every arrival stalled them all, so more ran at once, the
KV filled with paid replies and new paid requests waited for blocks.) While paid work runs, a
cap on free and background rows keeps each step short; with no paid work, idle capacity is
theirs (step_budget.py).

Lanes decide who gives way. When a running sequence cannot get a block, the lowest-lane newest
running sequence is preempted by recompute (background first, then free, newest first within a
lane), so a paid sequence is never preempted while a lower lane runs, and one without room takes
it from them; a paid or free sequence waiting for a block or a seat preempts lower-lane running
ones the same way. Background work is admitted only on idle capacity: nothing paid or free
waits and at least `background_min_free_fraction` of the usable KV blocks are free.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Collection, Mapping

from tandem.engine.kv_cache_manager import KvCacheManager
from tandem.engine.lane_queue import LaneQueue
from tandem.engine.scheduler_config import SchedulerConfig
from tandem.engine.scheduler_stats import MAX_QUEUE_WAITS, QueueWait, SchedulerStats
from tandem.engine.sequence import FinishReason, Lane, Sequence, SequenceStatus, StopReason
from tandem.engine.step_budget import StepBudget, max_chunk
from tandem.engine.step_plan import ScheduledChunk, StepPlan, UpdateResult

__all__ = [
    "EmptyPrompt",
    "PromptTooLong",
    "QueueWait",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepPlan",
    "UpdateResult",
]


class PromptTooLong(ValueError):
    """The prompt can never fit in this engine's KV cache or context window."""


class EmptyPrompt(ValueError):
    """A prompt with no tokens gives the model nothing to continue."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KvCacheManager) -> None:
        self.config = config
        self.kv = kv
        num_usable_blocks = kv.num_blocks - config.num_reserved_blocks
        if num_usable_blocks < 1:
            raise ValueError(f"{kv.num_blocks} KV blocks leave none above the {config.num_reserved_blocks} reserved")
        self._max_blocks_per_seq = num_usable_blocks
        max_tokens = num_usable_blocks * kv.block_size
        self._max_seq_tokens = min(max_tokens, config.max_model_len) if config.max_model_len else max_tokens
        self._num_usable_blocks = num_usable_blocks
        self._waiting: dict[Lane, LaneQueue] = {lane: LaneQueue() for lane in Lane}
        self._running: list[Sequence] = []  # oldest arrival first
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self._abort_ids: dict[str, None] = {}
        self._finished_ids: list[str] = []  # left scheduling since the last plan, for the runner to forget
        self._num_arrivals = 0
        self._num_preemptions = 0
        self._queue_waits: deque[QueueWait] = deque(maxlen=MAX_QUEUE_WAITS)

    # -- requests in and out --------------------------------------------------------------------

    def add(self, seq: Sequence, arrival_s: float = 0.0) -> None:
        """Queue a new sequence; refuses one that could never run. `arrival_s`: when it arrived
        (time.monotonic(), which every process of the machine shares); 0: now."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"{seq.seq_id}: only a fresh waiting sequence can be added")
        if seq.seq_id in self._seqs:
            raise ValueError(f"{seq.seq_id}: a sequence with this id is already scheduled")
        self.check(seq)
        seq.mark_arrived(self._num_arrivals, arrival_s or time.monotonic())
        self._num_arrivals += 1
        self._seqs[seq.seq_id] = seq
        self._waiting[seq.lane].append(seq)

    def check(self, seq: Sequence) -> None:
        """Raises EmptyPrompt or PromptTooLong for a sequence that could never run. Reads only the
        configuration, so a worker may ask from another thread before it queues the sequence."""
        if seq.num_prompt_tokens == 0:
            raise EmptyPrompt(f"{seq.seq_id}: the prompt is empty")
        num_blocks = self.kv.blocks_needed(seq.num_tokens)  # a continuation's generated tokens too
        if num_blocks > self._max_blocks_per_seq:
            raise PromptTooLong(
                f"{seq.seq_id}: a prompt of {seq.num_tokens} tokens needs {num_blocks} KV blocks of "
                f"{self.kv.block_size} tokens; this engine holds at most {self._max_blocks_per_seq} blocks "
                f"({self._max_blocks_per_seq * self.kv.block_size} tokens) per sequence: {self.kv.num_blocks} "
                f"blocks minus {self.config.num_reserved_blocks} reserved"
            )
        if self.config.max_model_len is not None and seq.num_tokens > self.config.max_model_len:
            raise PromptTooLong(
                f"{seq.seq_id}: a prompt of {seq.num_tokens} tokens is longer than the {self.config.max_model_len}-token context window"
            )

    def abort(self, seq_id: str) -> bool:
        """Cancel a waiting or running sequence at the next schedule(); False if it is not here."""
        if seq_id not in self._seqs:
            return False
        self._abort_ids[seq_id] = None
        return True

    def adopt(self, seq: Sequence, num_cached_tokens: int = 0) -> None:
        """Run a sequence prefilled elsewhere from its next decode on (decode side of a handoff).

        Its blocks must already be attached and filled (kv.reserve_import, the transfer, then
        seq.attach_computed_blocks) and its first token appended. Capacity is the caller's
        check: the reservation that preceded the transfer.
        """
        if seq.status is not SequenceStatus.WAITING or seq.seq_id in self._seqs:
            raise ValueError(f"{seq.seq_id}: only a new waiting sequence can be adopted")
        if seq.num_uncomputed_tokens < 1 or seq.num_computed_tokens > len(seq.block_table) * self.kv.block_size:
            raise ValueError(f"{seq.seq_id}: adopt needs blocks covering the computed tokens and a token to decode: {seq!r}")
        seq.mark_arrived(self._num_arrivals)
        self._num_arrivals += 1
        self._seqs[seq.seq_id] = seq
        seq.admit(num_cached_tokens)
        bisect.insort(self._running, seq, key=lambda s: s.arrival_order)

    def has_work(self) -> bool:
        return bool(self._seqs)

    def waiting_lanes(self) -> list[Lane]:
        """The lanes in which some sequence waits to be admitted."""
        return [lane for lane, queue in self._waiting.items() if queue]

    # -- the step -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        aborted = self._apply_aborts()
        plan = StepPlan(aborted=aborted, finished_seq_ids=self._finished_ids)
        self._finished_ids = []
        running = sorted(self._running, key=lambda s: s.lane)  # stable: oldest first within a lane
        decodes = [seq for seq in running if seq.num_uncomputed_tokens == 1]
        prefills = [seq for seq in running if seq.num_uncomputed_tokens > 1]
        budget = StepBudget.for_step(
            self.config.step_tokens(has_decodes=bool(decodes)),
            self.config.max_num_unpaid_tokens,
            is_paid_waiting=bool(self._waiting[Lane.PAID]),
            is_paid_running=any(seq.lane is Lane.PAID for seq in running),
        )
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            num_tokens_left = budget.left(plan, seq.lane)
            if num_tokens_left == 0:
                continue  # a paid sequence after it may still fit
            num_new_tokens = self._make_room(seq, min(max_chunk(seq, self.config.max_replayed_tokens_per_step), num_tokens_left), plan)
            if num_new_tokens:
                plan.add_chunk(seq, num_new_tokens, is_decode=seq.num_uncomputed_tokens == 1)
        self._admit(plan, budget)
        return plan

    def update(self, plan: StepPlan, sampled: Mapping[str, int], stopped_ids: Collection[str] = ()) -> UpdateResult:
        """Apply a step's results: computed counts, newly full blocks, sampled tokens.

        A sequence finishes when its new token ends it (an end or stop token, max_tokens, the
        context window, its grammar's completion, a repeating output) or its id is in `stopped_ids` (its text hit a stop string); its blocks
        are freed. A prefill-only sequence that got a token and did not finish is handed off:
        no longer scheduled, its blocks kept for the caller to export and free (kv.free).
        """
        finished, handed_off = [], []
        for chunk in plan.scheduled:
            seq = chunk.seq
            seq.advance_computed(chunk.num_new_tokens)
            self.kv.cache_full_blocks(seq)
            if not chunk.is_sampled:
                continue
            if seq.seq_id not in sampled:
                raise KeyError(f"{seq.seq_id}: its chunk completes the sequence but no token was sampled for it")
            seq.append_token(sampled[seq.seq_id])
            if seq.num_output_tokens == 1 and seq.arrival_s:  # not an import: its first token came with it
                self._queue_waits.append(QueueWait(seq.lane, time.monotonic() - seq.arrival_s, until="first_token"))
            ending = self._ending(seq, has_hit_stop_string=seq.seq_id in stopped_ids)
            if ending is not None:
                self._retire(seq, *ending)
                finished.append(seq)
            elif seq.is_prefill_only:
                self._hand_off(seq)
                handed_off.append(seq)
        return UpdateResult(finished, handed_off)

    def stats(self) -> SchedulerStats:
        running, running_blocks = dict.fromkeys(Lane, 0), dict.fromkeys(Lane, 0)
        for seq in self._running:
            running[seq.lane] += 1
            running_blocks[seq.lane] += len(seq.block_table)
        waiting_tokens = {lane: sum(seq.num_uncomputed_tokens for seq in queue) for lane, queue in self._waiting.items()}
        prefilling_tokens = dict.fromkeys(Lane, 0)
        for seq in self._running:
            if seq.num_uncomputed_tokens > 1:
                prefilling_tokens[seq.lane] += seq.num_uncomputed_tokens
        return SchedulerStats(
            num_running=running,
            num_waiting={lane: len(queue) for lane, queue in self._waiting.items()},
            num_free_blocks=self.kv.num_free_blocks,
            num_cached_blocks=self.kv.num_cached_blocks,
            num_used_blocks=self.kv.num_used_blocks,
            num_prefix_hit_tokens=self.kv.num_prefix_hit_tokens,
            num_preemptions=self._num_preemptions,
            num_queued_prefill_tokens=sum(waiting_tokens.values()) + sum(prefilling_tokens.values()),
            num_waiting_prefill_tokens=waiting_tokens,
            num_running_prefill_tokens=prefilling_tokens,
            num_running_blocks=running_blocks,
            has_idle_capacity=self._has_idle_capacity(),
            num_blocks=self.kv.num_blocks,
            num_prefix_query_tokens=self.kv.num_prefix_query_tokens,
        )

    def drain_queue_waits(self) -> list[QueueWait]:
        """The queue waits of sequences first admitted, and the times to first token of those
        that got one, since the last drain (the newest MAX_QUEUE_WAITS of them)."""
        waits = list(self._queue_waits)
        self._queue_waits.clear()
        return waits

    # -- inside a step --------------------------------------------------------------------------

    def _make_room(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> int:
        """Allocate blocks for up to `num_tokens` of a running sequence, preempting the lowest-lane
        newest running sequence while none is free (`seq` itself when it is that one).

        Returns how many tokens got room: fewer than asked when only part fits, 0 when `seq`
        itself got preempted.
        """
        while (num_fitting := self.kv.max_new_tokens(seq)) < 1:
            victim = max(self._running, key=_give_way_order)  # `seq` runs: never a higher lane than it
            self._preempt(victim, plan)
            if victim is seq:
                return 0
        num_tokens = min(num_tokens, num_fitting)
        self.kv.allocate_slots(seq, num_tokens)
        return num_tokens

    def _admit(self, plan: StepPlan, budget: StepBudget) -> None:
        """Admissions by lane, round-robin by user within one, while blocks, seats and budget last.
        A waiting sequence without a seat or blocks takes them from lower-lane running ones; once
        it did, no lower lane is admitted this step (the preempted would come straight back). A
        lane with a sequence preempted this step gets nobody new either (its blocks ran out), but
        a higher lane still does: a paid request is not held back by free sequences' churn."""
        for lane in Lane:
            if any(victim.lane <= lane for victim in plan.preempted):
                return
            queue = self._waiting[lane]
            while (seq := queue.peek()) is not None and budget.left(plan, lane) > 0:
                if lane is Lane.BACKGROUND and not self._has_idle_capacity():
                    return  # checked before each: the previous admission took blocks
                if not self._find_seat(seq, plan):
                    return
                num_hit_tokens = self.kv.find_cached_prefix(seq)
                num_fitting = self.kv.max_new_tokens(seq, self.config.num_reserved_blocks)
                while num_fitting < 1 and self._preempt_below(seq.lane, plan):
                    num_fitting = self.kv.max_new_tokens(seq, self.config.num_reserved_blocks)
                num_new_tokens = min(max_chunk(seq, self.config.max_replayed_tokens_per_step), budget.left(plan, lane), num_fitting)
                if num_new_tokens < 1:
                    self.kv.free(seq)  # give the prefix back; it stays cached
                    return  # out of blocks: lower lanes must not overtake this one
                self.kv.allocate_slots(seq, num_new_tokens)
                queue.pop()
                if seq.num_preemptions == 0:  # a recompute's wait is not a new request's
                    self._queue_waits.append(QueueWait(seq.lane, time.monotonic() - seq.arrival_s))
                seq.admit()
                plan.num_admitted[lane] = plan.num_admitted.get(lane, 0) + 1
                bisect.insort(self._running, seq, key=lambda s: s.arrival_order)
                self.kv.count_prefix_lookup(seq.num_tokens, num_hit_tokens)
                plan.add_chunk(seq, num_new_tokens, is_decode=False)
            if any(victim.lane > lane for victim in plan.preempted):
                return

    def _find_seat(self, seq: Sequence, plan: StepPlan) -> bool:
        """A free seat (max_num_seqs) for `seq`, made by preempting a lower lane if need be."""
        while len(self._running) >= self.config.max_num_seqs:
            if not self._preempt_below(seq.lane, plan):
                return False
        return True

    def _preempt_below(self, lane: Lane, plan: StepPlan) -> bool:
        """Preempts the lowest-lane newest running sequence of a lane below `lane`; False if none runs."""
        victim = max(self._running, key=_give_way_order, default=None)
        if victim is None or victim.lane <= lane:
            return False
        self._preempt(victim, plan)
        return True

    def _has_idle_capacity(self) -> bool:
        """Background work may start: nothing paid or free waits, and blocks are plentiful."""
        if len(self._waiting[Lane.PAID]) or len(self._waiting[Lane.FREE]):
            return False
        num_free_usable = self.kv.num_free_blocks - self.config.num_reserved_blocks
        return num_free_usable >= self.config.background_min_free_fraction * self._num_usable_blocks

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Back to the front of its lane, to be recomputed; a chunk it got this step is withdrawn."""
        plan.withdraw(seq)
        self.kv.free(seq)
        seq.preempt()
        self._running.remove(seq)
        self._waiting[seq.lane].push_front(seq)
        self._num_preemptions += 1
        plan.preempted.append(seq)

    def _apply_aborts(self) -> list[Sequence]:
        aborted = []
        for seq_id in self._abort_ids:
            seq = self._seqs.get(seq_id)
            if seq is not None:
                self._retire(seq, FinishReason.CANCELLED)
                aborted.append(seq)
        self._abort_ids.clear()
        return aborted

    def _ending(self, seq: Sequence, has_hit_stop_string: bool) -> tuple[FinishReason, StopReason | None] | None:
        """What the new last token ends, if anything, and why where the finish does not say: a
        stop string counts only when the token itself does not end the sequence (LENGTH stays
        LENGTH), and a repeating output (the repetition stop) ends it with LENGTH only when
        nothing else does."""
        token_id = seq.last_token_id
        if (token_id in seq.eos_token_ids and not seq.sampling.ignore_eos) or token_id in seq.sampling.stop_token_ids:
            return FinishReason.STOP, None
        if seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self._max_seq_tokens:
            return FinishReason.LENGTH, None
        if has_hit_stop_string or seq.has_finished_grammar:
            return FinishReason.STOP, None
        repetition = self.config.repetition_stop
        if repetition is not None and repetition.repeated_ngram(seq) is not None:
            return FinishReason.LENGTH, StopReason.REPETITION
        return None

    def _retire(self, seq: Sequence, reason: FinishReason, stop_reason: StopReason | None = None) -> None:
        """Take an unfinished sequence out of every queue, free its blocks, mark it finished."""
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._waiting[seq.lane].remove(seq)
        self.kv.free(seq)
        seq.finish(reason, stop_reason)
        del self._seqs[seq.seq_id]
        self._finished_ids.append(seq.seq_id)

    def _hand_off(self, seq: Sequence) -> None:
        """Stop scheduling a running sequence but leave it its blocks (prefill side of a handoff)."""
        self._running.remove(seq)
        del self._seqs[seq.seq_id]
        self._finished_ids.append(seq.seq_id)


def _give_way_order(seq: Sequence) -> tuple[Lane, int]:
    """The running sequence with the largest key gives way first: the lowest lane, then the newest."""
    return seq.lane, seq.arrival_order
