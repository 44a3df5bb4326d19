"""A followed token log's events as a chat stream gets them, for the integration tests that
follow one (the failover drills, the Redis role users)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tandem.v1.tokens_pb2 import TokenEvent


class Collect:
    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.ended: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

    def deliver(self, events: Sequence[TokenEvent], is_caught_up: bool) -> None:
        self.seqs += [event.seq for event in events]

    def end(self, error: Exception | None) -> None:
        self.ended.set_result(error)
