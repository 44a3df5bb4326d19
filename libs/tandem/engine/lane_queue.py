"""One lane's waiting sequences, served round-robin by user: the next admission goes to the next
user in rotation, each user's own sequences in arrival order. One user with 50 queued requests
therefore delays another user's single request by one admission, not by 50.

A preempted sequence goes back to the front of its user's queue, and its user to the front of
the rotation, so the work that was already running resumes first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from tandem.engine.sequence import Sequence


class LaneQueue:
    def __init__(self) -> None:
        self._by_user: OrderedDict[str, deque[Sequence]] = OrderedDict()  # rotation order: next user first
        self._num_seqs = 0

    def __len__(self) -> int:
        return self._num_seqs

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self._by_user.values():
            yield from queue

    def append(self, seq: Sequence) -> None:
        """A new arrival: last of its user's queue; a user new to the rotation joins it last."""
        self._by_user.setdefault(seq.user_id, deque()).append(seq)
        self._num_seqs += 1

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: first of its user's queue, its user first in the rotation."""
        self._by_user.setdefault(seq.user_id, deque()).appendleft(seq)
        self._by_user.move_to_end(seq.user_id, last=False)
        self._num_seqs += 1

    def peek(self) -> Sequence | None:
        """The sequence the next admission takes, or None when the lane is empty."""
        for queue in self._by_user.values():
            return queue[0]
        return None

    def pop(self) -> Sequence:
        """Takes the next user's first sequence; that user goes to the back of the rotation."""
        user_id, queue = next(iter(self._by_user.items()))
        seq = queue.popleft()
        if queue:
            self._by_user.move_to_end(user_id)
        else:
            del self._by_user[user_id]
        self._num_seqs -= 1
        return seq

    def remove(self, seq: Sequence) -> None:
        queue = self._by_user[seq.user_id]
        queue.remove(seq)
        if not queue:
            del self._by_user[seq.user_id]
        self._num_seqs -= 1
