"""A worker's events are cut into batches that keep their order and stay under the size bounds,
and each batch's message id is its own: stable for its retries, never reused by another batch or
another publisher (a restarted worker) inside JetStream's duplicate window."""

from tandem.bus import token_batches
from tandem.bus.token_batches import MAX_BATCH_BYTES, MAX_BATCH_EVENTS, BatchNumbers, batches
from tandem.v1.tokens_pb2 import TokenEvent


def _events(num: int, text: str = "x") -> list[TokenEvent]:
    return [TokenEvent(reply_id=f"r{i % 3}", seq=i // 3 + 1, text=text, worker_id="w1") for i in range(num)]


def test_a_step_of_events_is_one_batch_in_the_order_given():
    events = _events(64)
    [batch] = list(batches("w1", events))
    assert batch.worker_id == "w1"
    assert list(batch.events) == events


def test_a_step_past_the_bounds_is_cut_into_batches_that_keep_every_events_order():
    many = _events(2 * MAX_BATCH_EVENTS + 5)
    cut = list(batches("w1", many))
    assert [len(b.events) for b in cut] == [MAX_BATCH_EVENTS, MAX_BATCH_EVENTS, 5]
    assert [e for b in cut for e in b.events] == many
    large = _events(8, text="y" * (MAX_BATCH_BYTES // 3))
    cut = list(batches("w1", large))
    assert all(b.ByteSize() <= MAX_BATCH_BYTES + 64 for b in cut) and len(cut) == 4
    assert [e for b in cut for e in b.events] == large
    assert list(batches("w1", [])) == []


def test_batch_ids_count_up_per_publisher_and_differ_between_publishers_of_one_worker():
    first, restarted = BatchNumbers("w1"), BatchNumbers("w1")
    ids = [first.next_id() for _ in range(3)]
    assert len(set(ids)) == 3 and all(i.startswith("w1:") for i in ids)
    assert ids[0].rsplit(":", 1)[1] == "1" and ids[2].rsplit(":", 1)[1] == "3"
    assert restarted.next_id() not in ids


def test_a_watcher_reads_a_batch_and_a_single_event_alike():
    class Message:
        def __init__(self, subject: str, data: bytes) -> None:
            self.subject, self.data = subject, data

    events = _events(4)
    [batch] = list(batches("w1", events))
    assert token_batches.events_in(Message("tandem.v1.tokens.batch.w1", batch.SerializeToString())) == events  # type: ignore[arg-type]
    assert token_batches.events_in(Message("tandem.v1.tokens.r0", events[0].SerializeToString())) == events[:1]  # type: ignore[arg-type]
