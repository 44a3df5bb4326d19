"""`GET /v1/usage?since=`: a date, at most MAX_USAGE_DAYS back; without it, the last 31 days."""

from __future__ import annotations

from datetime import date

import pytest

from services.chat.errors import InvalidRequest
from services.chat.usage_api import DEFAULT_DAYS, since_day
from tandem.store.usage import MAX_USAGE_DAYS

TODAY = date(2025, 3, 14)


def test_without_since_the_last_31_days_are_answered():
    assert since_day(None, TODAY) == date(2025, 2, 12)
    assert (TODAY - since_day(None, TODAY)).days == DEFAULT_DAYS - 1


def test_since_may_reach_back_to_the_bound_and_no_further():
    assert since_day("2024-02-09", TODAY) == date(2024, 2, 9)
    assert (TODAY - date(2024, 2, 9)).days == MAX_USAGE_DAYS - 1
    with pytest.raises(InvalidRequest) as refused:
        since_day("2024-02-08", TODAY)
    assert refused.value.param == "since"


def test_since_that_is_not_a_date_is_refused():
    with pytest.raises(InvalidRequest):
        since_day("2025-02-30", TODAY)
