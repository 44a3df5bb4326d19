"""The usage ledger on Cassandra: a row per reply, written twice, read summed.

- usage_by_user ((user_id, month), day, model, reply_id) - a user's replies, a partition per
  calendar month (UTC), so `GET /v1/usage` reads one partition per month it covers and no
  partition grows without bound.
- usage_by_day ((day, shard), user_id, model, reply_id) - every user's replies of a day, spread
  over NUM_DAY_SHARDS partitions by the reply id, for the admin export.

A row per reply, not counters: a counter update that times out may or may not have been applied,
so no retry of it can be exact, and JetStream redelivers final events and the relay retries its
store writes. A reply's row is the same row whoever writes it and however often (plain INSERTs of
values fixed when its log closed), so the ledger counts each reply once without a Paxos round.
The sums are made on read: a user's month is their replies of that month.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterator
from datetime import date, timedelta
from typing import Any

from tandem.store.cassandra_session import CassandraSession
from tandem.store.usage import ReplyUsage, UsageRow, sum_by_user_model_day

NUM_DAY_SHARDS = 16
PAGE_SIZE = 1000
MAX_CONCURRENT_READS = 32


def day_shard(reply_id: str) -> int:
    return zlib.crc32(reply_id.encode()) % NUM_DAY_SHARDS


def _month(day: date) -> str:
    return day.strftime("%Y-%m")


def _days(first: date, last: date) -> Iterator[date]:
    day = first
    while day <= last:
        yield day
        day += timedelta(days=1)


def _months(first: date, last: date) -> list[str]:
    return sorted({_month(day) for day in _days(first.replace(day=1), last)})


def _tokens(row: dict[str, Any]) -> tuple[int, int, int]:
    return row["prompt_tokens"] or 0, row["cached_tokens"] or 0, row["completion_tokens"] or 0


async def record(session: CassandraSession, usage: ReplyUsage) -> None:
    day, tokens = usage.day.isoformat(), (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
    await asyncio.gather(
        session.run("usage_by_user", usage.user_id, _month(usage.day), day, usage.model, usage.reply_id, *tokens),
        session.run("usage_by_day", day, day_shard(usage.reply_id), usage.user_id, usage.model, usage.reply_id, *tokens),
    )


async def of_user(session: CassandraSession, user_id: str, since: date, until: date) -> list[UsageRow]:
    """The user's usage from `since` on, read from the months up to `until`'s."""

    async def month_of(month: str) -> list[ReplyUsage]:
        rows = session.pages("usage_of_user", (user_id, month, since.isoformat()), PAGE_SIZE)
        return [ReplyUsage(row["reply_id"], user_id, row["model"], date.fromisoformat(row["day"]), *_tokens(row)) async for row in rows]

    months = await asyncio.gather(*(month_of(month) for month in _months(since, until)))
    return sum_by_user_model_day(reply for month in months for reply in month)


async def every_user(session: CassandraSession, since: date, until: date) -> list[UsageRow]:
    """Every user's usage from `since` to `until`: each day's shards, a bounded number at a time."""
    gate = asyncio.Semaphore(MAX_CONCURRENT_READS)

    async def shard_of(day: date, shard: int) -> list[ReplyUsage]:
        async with gate:
            rows = session.pages("usage_of_day", (day.isoformat(), shard), PAGE_SIZE)
            return [ReplyUsage(row["reply_id"], row["user_id"], row["model"], day, *_tokens(row)) async for row in rows]

    shards = await asyncio.gather(*(shard_of(day, shard) for day in _days(since, until) for shard in range(NUM_DAY_SHARDS)))
    return sum_by_user_model_day(reply for shard in shards for reply in shard)
