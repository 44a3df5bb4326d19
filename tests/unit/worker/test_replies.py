"""The replies a worker holds: claimed from acceptance until their stream (or handoff) ends, never
once the worker gave them up; the drain waits for the last one."""

from __future__ import annotations

from tandem.worker.replies import HeldReplies


def test_streams_and_holds_are_claimed_until_they_end():
    replies = HeldReplies()
    first = replies.stream("a", first_seq=4, epoch=2)
    replies.hold("b")
    assert replies.claimed() == ["a", "b"]
    assert (first.next_seq, first.epoch) == (4, 2)
    replies.let_go("b")
    replies.end_stream("a")
    assert replies.claimed() == []


def test_ending_a_replaced_stream_keeps_its_replacement():
    replies = HeldReplies()
    old = replies.stream("a", first_seq=1, epoch=0)
    new = replies.stream("a", first_seq=7, epoch=1)
    replies.end_stream("a", old)
    assert replies.stream_of("a") is new and replies.claimed() == ["a"]


def test_released_replies_are_neither_claimed_nor_streamed():
    replies = HeldReplies()
    replies.stream("a", first_seq=1, epoch=0)
    replies.hold("b")
    replies.release_all()
    assert replies.claimed() == [] and replies.stream_of("a") is None


async def test_waiting_for_none_held_times_out_or_returns_when_the_last_one_ends():
    replies = HeldReplies()
    assert await replies.wait_none_held(0.01)
    replies.stream("a", first_seq=1, epoch=0)
    assert not await replies.wait_none_held(0.01)
    replies.end_stream("a")
    assert await replies.wait_none_held(0.01)


def test_the_next_seq_outlives_the_stream_so_a_cancel_racing_its_end_numbers_after_it():
    replies = HeldReplies()
    assert replies.next_seq("r1") is None  # never streamed here
    stream = replies.stream("r1", first_seq=5, epoch=1)
    assert replies.next_seq("r1") == 5
    stream.next_seq += 1  # the publisher numbered the first token
    replies.end_stream("r1", stream)  # the handoff took it after that token
    assert replies.next_seq("r1") == 6
