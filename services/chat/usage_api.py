"""`GET /v1/usage`: the caller's usage ledger (tandem.store.usage), per model and UTC day: the
messages answered and their prompt, cached and completion tokens, as each reply reported them.
The relay writes a reply's usage once its log closes, so a reply counts a moment after its last
event, not while it runs."""

from __future__ import annotations

from datetime import date, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from services.chat.deps import Chat, CurrentUser
from services.chat.errors import InvalidRequest
from tandem.store import UsageRow
from tandem.store.usage import MAX_USAGE_DAYS, earliest_day, today_utc

router = APIRouter(prefix="/v1/usage", tags=["usage"])
DEFAULT_DAYS = 31  # without `since`: today and the 30 days before it


class UsageDay(BaseModel):
    model: str
    day: str  # YYYY-MM-DD, UTC
    messages: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, row: UsageRow) -> UsageDay:
        return cls(
            model=row.model,
            day=row.day.isoformat(),
            messages=row.messages,
            prompt_tokens=row.prompt_tokens,
            cached_tokens=row.cached_tokens,
            completion_tokens=row.completion_tokens,
        )


class UsageList(BaseModel):
    data: list[UsageDay]


def since_day(since: str | None, today: date) -> date:
    """The first day asked for; InvalidRequest for one that is not a date or reaches back too far."""
    if since is None:
        return today - timedelta(days=DEFAULT_DAYS - 1)
    try:
        day = date.fromisoformat(since)
    except ValueError:
        raise InvalidRequest(f"since must be a date as YYYY-MM-DD; got {since!r}", param="since") from None
    if day < earliest_day(today):
        raise InvalidRequest(f"since may reach back {MAX_USAGE_DAYS} days at most, to {earliest_day(today).isoformat()}", param="since")
    return day


@router.get("", response_model=UsageList)
async def usage(
    state: Chat,
    user: CurrentUser,
    since: Annotated[
        str | None,
        Query(
            pattern=r"^\d{4}-\d{2}-\d{2}$",
            description=f"the first UTC day (YYYY-MM-DD), at most {MAX_USAGE_DAYS} days ago; default: the last {DEFAULT_DAYS} days",
        ),
    ] = None,
) -> UsageList:
    """The caller's usage per model and UTC day, oldest day first."""
    rows = await state.store.usage_of(user.user_id, since=since_day(since, today_utc()))
    return UsageList(data=[UsageDay.of(row) for row in rows])
