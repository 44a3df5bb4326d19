"""How a quota refusal says when to come back: in words for people, in OpenAI's duration form
for the rate-limit headers."""

from __future__ import annotations

import pytest

from services.chat.quotas import reset_duration, wait_phrase


@pytest.mark.parametrize(
    ("seconds", "phrase"),
    [(0.2, "1 second"), (45, "45 seconds"), (89.5, "90 seconds"), (90, "2 minutes"), (720, "12 minutes"), (10800, "180 minutes")],
)
def test_a_wait_is_said_in_seconds_then_whole_minutes_rounded_up(seconds, phrase):
    assert wait_phrase(seconds) == phrase


@pytest.mark.parametrize(("seconds", "duration"), [(0, "0s"), (44.1, "45s"), (360, "6m0s"), (7501, "2h5m1s")])
def test_a_reset_time_reads_as_openai_writes_it(seconds, duration):
    assert reset_duration(seconds) == duration
