"""The usage ledger's contract on both stores, Cassandra's real node included: a reply written
again, or by several writers at once, counts once; usage sums per model and UTC day, from the day
asked on, across Cassandra's month partitions; the export holds every user's days, across its
day shards."""

from __future__ import annotations

import asyncio
import uuid
from datetime import date, timedelta

from tandem.store import ConversationStore, ReplyUsage, UsageRow
from tandem.store.usage import today_utc


def reply(user_id: str, day: date, model: str = "smollm2@1", tokens: tuple[int, int, int] = (10, 4, 5)) -> ReplyUsage:
    return ReplyUsage(f"reply-{uuid.uuid4().hex}", user_id, model, day, *tokens)


async def test_a_reply_written_again_and_by_writers_at_once_counts_once(new_store):
    user, today = f"user-{uuid.uuid4().hex}", today_utc()
    first, second = await new_store(), await new_store()
    once = reply(user, today)
    await first.record_usage(once)
    await asyncio.gather(*(store.record_usage(once) for store in (first, second, first, second)))  # redelivered, retried
    await second.record_usage(reply(user, today, tokens=(3, 0, 7)))
    for store in (first, second):
        assert await store.usage_of(user, since=today) == [UsageRow(user, "smollm2@1", today, 2, 13, 4, 12)]


async def test_usage_sums_per_model_and_day_from_the_day_asked_across_months(store: ConversationStore):
    user, today = f"user-{uuid.uuid4().hex}", today_utc()
    days = [today - timedelta(days=40), today - timedelta(days=1), today]  # at least two calendar months
    for day in days:
        await store.record_usage(reply(user, day))
    await store.record_usage(reply(user, today, model="smollm2@2", tokens=(1, 0, 1)))
    await store.record_usage(reply(user, today, model="smollm2@2", tokens=(2, 1, 2)))
    await store.record_usage(reply(f"other-{user}", today))
    assert await store.usage_of(user, since=days[0]) == [
        UsageRow(user, "smollm2@1", days[0], 1, 10, 4, 5),
        UsageRow(user, "smollm2@1", days[1], 1, 10, 4, 5),
        UsageRow(user, "smollm2@1", today, 1, 10, 4, 5),
        UsageRow(user, "smollm2@2", today, 2, 3, 1, 3),
    ]
    assert [row.day for row in await store.usage_of(user, since=days[1])] == [days[1], today, today]


async def test_the_export_holds_every_users_days_from_the_first_asked(store: ConversationStore):
    users, today = [f"user-{uuid.uuid4().hex}" for _ in range(3)], today_utc()
    yesterday = today - timedelta(days=1)
    for user in users:
        for _ in range(5):  # replies spread over the day's shards
            await store.record_usage(reply(user, today))
        await store.record_usage(reply(user, yesterday - timedelta(days=1)))  # before the export's first day
    exported = [row for row in await store.usage_since(yesterday) if row.user_id in users]
    assert exported == [UsageRow(user, "smollm2@1", today, 5, 50, 20, 25) for user in sorted(users)]
