"""The router's prefix index: KV events applied in order, a full state fetched on a gap or when
heartbeats stay ahead, events newer than the state applied after it, silent workers dropped."""

from __future__ import annotations

import asyncio

import nats.errors

from services.router.prefix_index import PrefixIndex
from services.router.workers import WorkerRegistry
from tandem.v1.kv_pb2 import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent, KvState, StoredBlock
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat


def stored(worker_id: str, event_id: int, *hashes: int) -> KvEvent:
    return KvEvent(
        worker_id=worker_id, event_id=event_id, stored=BlocksStored(blocks=[StoredBlock(block_hash=h, num_tokens=16) for h in hashes])
    )


def removed(worker_id: str, event_id: int, *hashes: int) -> KvEvent:
    return KvEvent(worker_id=worker_id, event_id=event_id, removed=BlocksRemoved(block_hashes=hashes))


def cleared(worker_id: str, event_id: int) -> KvEvent:
    return KvEvent(worker_id=worker_id, event_id=event_id, cleared=AllBlocksCleared())


def state(worker_id: str, event_id: int, *hashes: int) -> KvState:
    return KvState(worker_id=worker_id, event_id=event_id, blocks=[StoredBlock(block_hash=h, num_tokens=16) for h in hashes])


def heartbeat(worker_id: str, kv_event_id: int, started_unix_ms: int = 1) -> WorkerHeartbeat:
    service = ServiceHeartbeat(role="decode", instance_id=worker_id, is_ready=True, started_unix_ms=started_unix_ms)
    return WorkerHeartbeat(service=service, kv_event_id=kv_event_id)


class StateServer:
    """The workers' kv_state answers, held until the test releases them."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self._answers: dict[str, asyncio.Future[KvState]] = {}
        self._was_asked = asyncio.Event()

    def fetch(self, worker_id: str) -> asyncio.Future[KvState]:
        self.asked.append(worker_id)
        self._was_asked.set()
        self._answers[worker_id] = asyncio.get_running_loop().create_future()
        return self._answers[worker_id]

    async def wait_asked(self, num_requests: int) -> None:
        while len(self.asked) < num_requests:
            self._was_asked.clear()
            await asyncio.wait_for(self._was_asked.wait(), 1)

    def answer(self, answer: KvState | Exception) -> None:
        future = self._answers.pop(answer.worker_id if isinstance(answer, KvState) else self.asked[-1])
        if isinstance(answer, Exception):
            future.set_exception(answer)
        else:
            future.set_result(answer)


def new_index() -> tuple[PrefixIndex, StateServer]:
    server = StateServer()
    return PrefixIndex(server.fetch), server


def held(index: PrefixIndex, worker_id: str, *hashes: int) -> bool:
    return index.num_prefix_blocks(worker_id, hashes) == len(hashes)


def holders(index: PrefixIndex, block_hash: int) -> set[str]:
    return {worker_id for worker_id in index.worker_ids() if held(index, worker_id, block_hash)}


async def test_stored_removed_and_cleared_events_change_who_holds_a_block():
    index, server = new_index()
    index.apply(stored("d1", 1, 11, 12, 13))
    index.apply(stored("d2", 1, 11))
    assert holders(index, 11) == {"d1", "d2"}
    assert holders(index, 12) == {"d1"}
    index.apply(removed("d1", 2, 11))
    assert holders(index, 11) == {"d2"}
    assert holders(index, 12) == {"d1"}
    index.apply(cleared("d1", 3))
    assert holders(index, 12) == holders(index, 13) == set()
    assert holders(index, 11) == {"d2"}
    assert (index.last_event_id("d1"), index.last_event_id("d2")) == (3, 1)
    assert server.asked == []


async def test_the_prefix_count_stops_at_the_first_block_a_worker_lacks():
    index, _ = new_index()
    index.apply(stored("d1", 1, 11, 12, 14))
    assert index.num_prefix_blocks("d1", [11, 12, 13, 14]) == 2
    assert index.num_prefix_blocks("d1", [12, 11]) == 2
    assert index.num_prefix_blocks("d1", [99, 11]) == 0
    assert index.num_prefix_blocks("unknown", [11]) == 0


async def test_a_gap_fetches_the_state_which_replaces_the_workers_entries():
    index, server = new_index()
    index.apply(stored("d1", 1, 11, 12))
    index.apply(stored("d1", 3, 14))  # event 2 was lost
    assert server.asked == ["d1"]
    assert held(index, "d1", 11, 12), "the old entries serve until the state arrives"
    assert not held(index, "d1", 14), "the event after the gap waits for the state"
    server.answer(state("d1", 3, 12, 14, 15))
    await index.wait_resynced()
    assert holders(index, 11) == set()
    assert held(index, "d1", 12) and held(index, "d1", 14) and held(index, "d1", 15)
    assert index.last_event_id("d1") == 3
    index.apply(stored("d1", 4, 16))  # and the next event applies as usual
    assert held(index, "d1", 16) and server.asked == ["d1"]


async def test_events_newer_than_the_state_are_applied_after_it_and_older_ones_dropped():
    index, server = new_index()
    index.apply(stored("d1", 5, 11))  # a router that joined late: the first event it sees is 5
    index.apply(stored("d1", 6, 12))
    index.apply(removed("d1", 7, 11))
    index.apply(stored("d1", 8, 13))
    assert server.asked == ["d1"], "one state request, whatever arrives while it is in flight"
    server.answer(state("d1", 6, 11, 12))  # as of event 6: events 5 and 6 are in it
    await index.wait_resynced()
    assert holders(index, 11) == set(), "event 7 removed it after the state"
    assert held(index, "d1", 12) and held(index, "d1", 13)
    assert index.last_event_id("d1") == 8


async def test_a_gap_among_the_held_back_events_asks_again():
    index, server = new_index()
    index.apply(stored("d1", 3, 11))
    index.apply(stored("d1", 9, 12))  # 4..8 lost while the first state request is out
    server.answer(state("d1", 3, 11))
    await server.wait_asked(2)  # the state is applied, then event 9 is a gap again
    assert server.asked == ["d1", "d1"]
    server.answer(state("d1", 9, 11, 12))
    await index.wait_resynced()
    assert held(index, "d1", 11, 12) and index.last_event_id("d1") == 9


async def test_a_failed_state_request_is_retried_at_the_next_event():
    index, server = new_index()
    index.apply(stored("d1", 2, 11))
    server.answer(nats.errors.TimeoutError())
    await index.wait_resynced()
    assert index.last_event_id("d1") == 0
    index.apply(stored("d1", 3, 12))
    assert server.asked == ["d1", "d1"]
    server.answer(state("d1", 3, 11, 12))
    await index.wait_resynced()
    assert held(index, "d1", 11, 12)


async def test_heartbeats_that_stay_ahead_of_the_events_fetch_the_state():
    index, server = new_index()
    index.apply(stored("d1", 1, 11))
    index.observe_heartbeat(heartbeat("d1", 1))
    index.observe_heartbeat(heartbeat("d1", 2))  # event 2 may still be on its way
    assert server.asked == []
    index.apply(stored("d1", 2, 12))
    index.observe_heartbeat(heartbeat("d1", 2))  # it arrived: all caught up
    assert server.asked == []
    index.observe_heartbeat(heartbeat("d1", 3))
    index.observe_heartbeat(heartbeat("d1", 3))  # event 3 was lost (and nothing came after it)
    assert server.asked == ["d1"]
    server.answer(state("d1", 3, 11, 12, 13))
    await index.wait_resynced()
    assert held(index, "d1", 11, 12, 13) and index.last_event_id("d1") == 3


async def test_a_worker_whose_events_were_all_missed_is_fetched_from_its_heartbeats():
    index, server = new_index()
    index.observe_heartbeat(heartbeat("d1", 0))
    index.observe_heartbeat(heartbeat("d1", 0))
    assert server.asked == [] and index.worker_ids() == frozenset()
    index.observe_heartbeat(heartbeat("d1", 40))
    index.observe_heartbeat(heartbeat("d1", 40))
    assert server.asked == ["d1"]
    server.answer(state("d1", 40, 11))
    await index.wait_resynced()
    assert held(index, "d1", 11)


async def test_a_restarted_worker_starts_over():
    index, server = new_index()
    index.apply(stored("d1", 1, 11))
    index.observe_heartbeat(heartbeat("d1", 1, started_unix_ms=1000))
    index.observe_heartbeat(heartbeat("d1", 0, started_unix_ms=2000))
    assert holders(index, 11) == set()
    index.apply(stored("d1", 1, 12))  # the new process's first event applies without a state request
    assert held(index, "d1", 12) and server.asked == []


async def test_a_worker_silent_past_expiry_leaves_the_index():
    clock_s = [100.0]
    index, _server = new_index()
    registry = WorkerRegistry(expiry_s=3.0, clock=lambda: clock_s[0], on_forget=index.forget)
    for worker_id in ("d1", "d2"):
        registry.observe(heartbeat(worker_id, 1))
        index.apply(stored(worker_id, 1, 11, 12))
    clock_s[0] += 2.0
    registry.observe(heartbeat("d2", 1))
    clock_s[0] += 1.5  # d1 silent for 3.5 s, d2 for 1.5 s
    assert [w.instance_id for w in registry.workers("decode")] == ["d2"]
    assert holders(index, 11) == holders(index, 12) == {"d2"}
    assert index.worker_ids() == {"d2"}


async def test_forgetting_a_worker_cancels_its_state_request():
    index, server = new_index()
    index.apply(stored("d1", 7, 11))
    assert server.asked == ["d1"]
    index.forget("d1")
    await index.wait_resynced()
    assert index.worker_ids() == frozenset() and holders(index, 11) == set()
