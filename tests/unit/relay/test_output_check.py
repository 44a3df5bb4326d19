"""The output check's cadence and window: a check every N tokens (also when an append logs
several at once, filling a gap), the newest characters only, the tier from the request's lane,
windows due together scored in one call of the check, and the check loaded in a process of its own
that goes when the relay does."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Sequence

import pytest
from helpers import REPO, is_running, wait_until

from services.relay.moderation import crosses_check, newest_chars, tier_of
from tandem.errors import StartupError
from tandem.safety import Blocklist
from tandem.safety_process import BatchScorer, CheckProcess
from tandem.v1.common_pb2 import LANE_BACKGROUND, LANE_FREE, LANE_PAID
from tandem.v1.generate_pb2 import GenerateRequest


def checked_seqs(appends: Sequence[tuple[int, int]], every_tokens: int) -> list[int]:
    """The log's last seq after each append (num appended, last seq) whose append calls for a check."""
    return [last for num, last in appends if crosses_check(last, num, every_tokens)]


def test_a_check_is_due_every_nth_token_of_a_reply_appended_one_by_one():
    assert checked_seqs([(1, seq) for seq in range(1, 30)], 8) == [8, 16, 24]
    assert checked_seqs([(1, seq) for seq in range(1, 5)], 1) == [1, 2, 3, 4]


def test_an_append_that_fills_a_gap_across_a_check_turn_checks_at_its_last_seq():
    # seq 7 arrives late: its append logs 7..10 at once, passing the turn at 8
    assert checked_seqs([(1, 5), (1, 6), (0, 6), (0, 6), (0, 6), (4, 10), (1, 11)], 8) == [10]


def test_a_duplicate_or_a_held_event_checks_nothing():
    assert not crosses_check(16, 0, 8)  # nothing appended: the log's last seq sits on a turn already checked


def test_the_window_is_the_newest_characters():
    assert newest_chars("abcdef", 4) == "cdef"
    assert newest_chars("abc", 4) == "abc"


def test_the_tier_is_the_lane_the_reply_was_asked_in():
    assert [tier_of(GenerateRequest(lane=lane).SerializeToString()) for lane in (LANE_PAID, LANE_FREE, LANE_BACKGROUND)] == [
        "paid",
        "free",
        "background",
    ]
    assert tier_of(b"") == "unknown"
    assert tier_of(GenerateRequest(reply_id="r").SerializeToString()) == "unknown"


class CountingBlocklist(Blocklist):
    """A blocklist that records each call's texts."""

    def __init__(self, terms: Sequence[str]) -> None:
        super().__init__(terms)
        self.calls: list[list[str]] = []

    def score(self, texts: Sequence[str]) -> list[float]:
        self.calls.append(list(texts))
        return super().score(texts)


async def test_windows_due_at_once_are_scored_in_one_call_each_with_its_own_verdict():
    check = CountingBlocklist(["forbidden"])

    async def score_batch(texts: list[str]) -> list[float]:
        return check.score(texts)

    scorer = BatchScorer(score_batch, max_batch=3)
    texts = ["plain words", "a forbidden word", "more plain words", "Forbidden!"]
    scores = await asyncio.gather(*(scorer.score(text) for text in texts))
    assert await scorer.score("later, alone") == 0.0
    assert scores == [0.0, 1.0, 0.0, 1.0]
    assert check.calls == [texts[:3], texts[3:], ["later, alone"]]  # at most max_batch a call


async def test_a_check_that_fails_fails_the_windows_of_its_call_and_the_next_call_runs():
    calls: list[list[str]] = []

    async def down_once(texts: list[str]) -> list[float]:
        calls.append(texts)
        if len(calls) == 1:
            raise RuntimeError("the moderation model is down")
        return [0.0] * len(texts)

    scorer = BatchScorer(down_once, max_batch=64)
    with pytest.raises(RuntimeError, match="moderation model"):
        await scorer.score("anything")
    assert await scorer.score("again") == 0.0


async def test_the_check_loads_once_in_a_process_of_its_own_and_scores_there():
    check = CheckProcess.start("blocklist:forbidden", "TANDEM_OUTPUT_MODERATION")
    assert check is not None and check.name == "blocklist"
    try:
        assert await check.score(["a forbidden word", "fine"]) == [1.0, 0.0]
    finally:
        check.close()
    assert CheckProcess.start("none", "TANDEM_OUTPUT_MODERATION") is None


def test_a_spec_that_names_no_check_stops_the_relay_at_its_start_naming_the_setting():
    with pytest.raises(StartupError, match="TANDEM_OUTPUT_MODERATION"):
        CheckProcess.start("no_such_module_here:factory", "TANDEM_OUTPUT_MODERATION")


# A relay in miniature: its check process started, its pid printed, then waiting to be killed.
RELAY_WITH_A_CHECK_PROCESS = """
import os, sys
from tandem.safety_process import _new_executor
print(_new_executor().submit(os.getpid).result(timeout=60), flush=True)
sys.stdin.read()
"""


async def test_a_relay_killed_with_sigkill_takes_its_check_process_with_it():
    relay = subprocess.Popen(
        [sys.executable, "-c", RELAY_WITH_A_CHECK_PROCESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True
    )
    try:
        child_pid = int(relay.stdout.readline())
        assert is_running(child_pid)
        relay.kill()
        relay.wait(timeout=10)

        async def gone() -> bool:
            return not is_running(child_pid)

        await wait_until(gone, timeout_s=10)  # before the fix the child waited on its queue forever
    finally:
        relay.kill()
        relay.wait()
