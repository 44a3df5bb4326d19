"""`tandem usage export --since DAY --format csv`: the store the settings name, every user's usage
per model and UTC day from DAY on, as CSV on stdout; a store that is not there is an error, not
an empty one made."""

from __future__ import annotations

import asyncio
import csv
import io
import os
from datetime import timedelta
from pathlib import Path

import pytest

from tandem import cli
from tandem.store import ReplyUsage
from tandem.store.sqlite import SqliteStore
from tandem.store.usage import MAX_USAGE_DAYS, today_utc


@pytest.fixture(autouse=True)
def store_settings(monkeypatch, tmp_path: Path) -> Path:
    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TANDEM_CONFIG", str(tmp_path / "absent.toml"))
    monkeypatch.setenv("TANDEM_STORE", "sqlite")
    monkeypatch.setenv("TANDEM_SQLITE_PATH", str(tmp_path / "store" / "conversations.db"))
    return tmp_path / "store" / "conversations.db"


async def _record(path: Path, replies: list[ReplyUsage]) -> None:
    store = SqliteStore(path)
    await store.start()
    for reply in replies:
        await store.record_usage(reply)
    await store.close()


def test_the_export_is_one_csv_row_per_user_model_and_day_since_the_day_asked(store_settings: Path, capsys):
    today, yesterday = today_utc(), today_utc() - timedelta(days=1)
    replies = [
        ReplyUsage("r1", "alice", "smollm2@1", yesterday, 10, 2, 3),
        ReplyUsage("r2", "alice", "smollm2@1", today, 10, 2, 3),
        ReplyUsage("r3", "alice", "smollm2@1", today, 5, 0, 1),
        ReplyUsage("r4", "bob", "big@7", today, 100, 50, 20),
    ]
    asyncio.run(_record(store_settings, replies))
    assert cli.main(["usage", "export", "--since", today.isoformat(), "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows == [
        ["user_id", "model", "day", "messages", "prompt_tokens", "cached_tokens", "completion_tokens"],
        ["alice", "smollm2@1", today.isoformat(), "2", "15", "2", "4"],
        ["bob", "big@7", today.isoformat(), "1", "100", "50", "20"],
    ]


def test_a_missing_store_is_an_error_and_is_not_created(store_settings: Path, capsys):
    assert cli.main(["usage", "export", "--since", today_utc().isoformat()]) == 2
    assert "no SQLite store" in capsys.readouterr().err
    assert not store_settings.exists()


@pytest.mark.parametrize("since", ["yesterday", (today_utc() - timedelta(days=MAX_USAGE_DAYS)).isoformat()])
def test_a_since_that_is_not_a_date_or_reaches_too_far_back_is_refused(since: str, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["usage", "export", "--since", since])
    assert exited.value.code == 2
    assert "--since" in capsys.readouterr().err
