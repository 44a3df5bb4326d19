"""Shadow answers on a real SQLite file: an answer reads back whole under the reply it mirrors, a
second write of it changes nothing, and a file written by schema 2 code (feedback and the usage
ledger, no shadow answers) gains the table at its next start, keeping what it held."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tandem.bus.events import ReplyStatus
from tandem.store import ReplyUsage, ShadowAnswer
from tandem.store import sqlite as sqlite_store
from tandem.store.sqlite import SqliteStore
from tandem.store.usage import utc_day

ANSWER = ShadowAnswer(
    reply_id="shadow-1",
    shadow_of="reply-1",
    user_id="alice",
    conversation_id="conv-1",
    model="smollm2@2",
    text="Bonjour ✓",
    num_output_tokens=4,
    status=ReplyStatus.MODERATED,
    finish="content_filter",
    stop_reason="",
    ttft_s=0.5,
    created_ms=1_000,
    finished_ms=2_000,
)


async def test_a_shadow_answer_reads_back_whole_and_a_second_write_changes_nothing(tmp_path: Path):
    store = SqliteStore(tmp_path / "conversations.db")
    await store.start()
    try:
        await store.record_shadow_answer(ANSWER)
        await store.record_shadow_answer(ShadowAnswer(**{**ANSWER.__dict__, "text": "a retry's other text"}))
        assert await store.shadow_answers("reply-1") == [ANSWER]
        assert await store.shadow_answers("shadow-1") == []  # read by the reply it mirrors, not its own id
    finally:
        await store.close()


async def test_a_schema_2_file_gains_shadow_answers_and_keeps_its_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "conversations.db"
    usage = ReplyUsage("reply-0", "alice", "smollm2@1", utc_day(1_741_910_400_000), 10, 4, 5)
    with monkeypatch.context() as schema_2:
        schema_2.setattr(sqlite_store, "SCHEMA_VERSION", 2)
        schema_2.setattr(sqlite_store, "_SCHEMA", [s for s in sqlite_store._SCHEMA if "shadow_answers" not in s])
        old = SqliteStore(path)
        await old.start()
        await old.record_usage(usage)
        await old.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
        assert db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'shadow_answers'").fetchone()[0] == 0
    new = SqliteStore(path)
    await new.start()
    try:
        await new.record_shadow_answer(ANSWER)
        assert await new.shadow_answers("reply-1") == [ANSWER]
        assert [row.messages for row in await new.usage_of("alice", since=usage.day)] == [1]
    finally:
        await new.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == sqlite_store.SCHEMA_VERSION == 3
