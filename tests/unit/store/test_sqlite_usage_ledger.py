"""The usage ledger on a real SQLite file: a reply counts once however often it is written, on
the UTC day it closed, summed per user, model and day; the export sees every user."""

from __future__ import annotations

import asyncio
from datetime import date
from pathlib import Path

import pytest

from tandem.store import ReplyUsage, UsageRow
from tandem.store.sqlite import SqliteStore
from tandem.store.usage import sum_by_user_model_day, utc_day

DAY = date(2025, 3, 14)


def reply(reply_id: str, user_id: str = "alice", model: str = "smollm2@1", day: date = DAY, tokens: tuple[int, int, int] = (10, 4, 5)):
    return ReplyUsage(reply_id, user_id, model, day, *tokens)


@pytest.fixture
async def store(tmp_path: Path):
    store = SqliteStore(tmp_path / "conversations.db")
    await store.start()
    yield store
    await store.close()


def test_a_moment_counts_on_its_utc_day_whatever_the_local_zone():
    midnight_ms = 1_741_910_400_000  # 2025-03-14T00:00:00Z
    assert utc_day(midnight_ms - 1) == date(2025, 3, 13)
    assert utc_day(midnight_ms) == date(2025, 3, 14)
    assert utc_day(midnight_ms + 86_400_000 - 1) == date(2025, 3, 14)


async def test_a_reply_written_again_counts_once(store: SqliteStore):
    await store.record_usage(reply("r1"))
    await asyncio.gather(*(store.record_usage(reply("r1")) for _ in range(3)))  # redelivered, retried
    await store.record_usage(reply("r2", tokens=(7, 0, 2)))
    assert await store.usage_of("alice", since=DAY) == [UsageRow("alice", "smollm2@1", DAY, 2, 17, 4, 7)]


async def test_usage_is_summed_per_model_and_day_and_kept_per_user(store: SqliteStore):
    before = date(2025, 3, 13)
    await store.record_usage(reply("r1", day=before))
    await store.record_usage(reply("r2"))
    await store.record_usage(reply("r3", model="smollm2@2", tokens=(1, 1, 1)))
    await store.record_usage(reply("r4", user_id="bob", tokens=(100, 0, 50)))
    assert await store.usage_of("alice", since=before) == [
        UsageRow("alice", "smollm2@1", before, 1, 10, 4, 5),
        UsageRow("alice", "smollm2@1", DAY, 1, 10, 4, 5),
        UsageRow("alice", "smollm2@2", DAY, 1, 1, 1, 1),
    ]
    assert await store.usage_of("alice", since=DAY) == [
        UsageRow("alice", "smollm2@1", DAY, 1, 10, 4, 5),
        UsageRow("alice", "smollm2@2", DAY, 1, 1, 1, 1),
    ]
    assert await store.usage_of("carol", since=before) == []


async def test_the_export_holds_every_user_from_its_first_day_on(store: SqliteStore):
    await store.record_usage(reply("r1", day=date(2025, 3, 13)))
    await store.record_usage(reply("r2", user_id="bob"))
    await store.record_usage(reply("r3"))
    assert await store.usage_since(DAY) == [
        UsageRow("alice", "smollm2@1", DAY, 1, 10, 4, 5),
        UsageRow("bob", "smollm2@1", DAY, 1, 10, 4, 5),
    ]


async def test_the_ledger_survives_a_restart(tmp_path: Path):
    first = SqliteStore(tmp_path / "conversations.db")
    await first.start()
    await first.record_usage(reply("r1"))
    await first.close()
    again = SqliteStore(tmp_path / "conversations.db")
    await again.start()
    await again.record_usage(reply("r1"))
    assert await again.usage_since(DAY) == [UsageRow("alice", "smollm2@1", DAY, 1, 10, 4, 5)]
    await again.close()


def test_the_sums_in_code_match_the_sums_in_sql_order():
    replies = [reply("a", user_id="bob"), reply("b"), reply("c", day=date(2025, 3, 1)), reply("d")]
    assert sum_by_user_model_day(replies) == [
        UsageRow("alice", "smollm2@1", date(2025, 3, 1), 1, 10, 4, 5),
        UsageRow("alice", "smollm2@1", DAY, 2, 20, 8, 10),
        UsageRow("bob", "smollm2@1", DAY, 1, 10, 4, 5),
    ]
