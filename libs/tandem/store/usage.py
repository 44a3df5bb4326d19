"""The usage ledger's records: what one reply used (written once per reply, when its log closes)
and what a user used of a model on a UTC day (the sum of their replies, read for `GET /v1/usage`
and the admin export).

A reply's usage is keyed by its reply id, so writing it again (a redelivered final event, a
retried store write) changes nothing: the ledger counts every reply exactly once. The day is the
UTC day the reply's log closed, fixed when it closed, so every retry lands on the same day."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

# How far back a usage query may reach: `GET /v1/usage?since=` and `tandem usage export --since`.
MAX_USAGE_DAYS = 400


def utc_day(unix_ms: int) -> date:
    """The UTC day a moment in unix ms falls on."""
    return datetime.fromtimestamp(unix_ms / 1000, tz=UTC).date()


def today_utc() -> date:
    return datetime.now(tz=UTC).date()


def earliest_day(today: date) -> date:
    """The oldest day a usage query may ask for."""
    return today - timedelta(days=MAX_USAGE_DAYS - 1)


@dataclass(frozen=True)
class ReplyUsage:
    """One reply's tokens, as its final event reported them (its `done` usage, OpenAI's `usage`)."""

    reply_id: str
    user_id: str
    model: str  # the served model that wrote it, `name@version` kept whole
    day: date  # UTC, the day its log closed
    prompt_tokens: int
    cached_tokens: int  # of the prompt tokens, those read from the prefix cache
    completion_tokens: int


@dataclass(frozen=True)
class UsageRow:
    """A user's usage of one model on one UTC day: their replies' tokens summed."""

    user_id: str
    model: str
    day: date
    messages: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def sum_by_user_model_day(replies: Iterable[ReplyUsage]) -> list[UsageRow]:
    """The replies summed per user, model and day, ordered by day, user and model."""
    totals: dict[tuple[date, str, str], list[int]] = {}
    for reply in replies:
        total = totals.setdefault((reply.day, reply.user_id, reply.model), [0, 0, 0, 0])
        total[0] += 1
        total[1] += reply.prompt_tokens
        total[2] += reply.cached_tokens
        total[3] += reply.completion_tokens
    return [
        UsageRow(user_id=user_id, model=model, day=day, messages=n, prompt_tokens=p, cached_tokens=c, completion_tokens=o)
        for (day, user_id, model), (n, p, c, o) in sorted(totals.items())
    ]
