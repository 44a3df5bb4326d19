"""The embedded conversation store: one SQLite file shared by the chat and relay processes.

WAL lets readers run beside the one writer; every write is a short `BEGIN IMMEDIATE`
transaction (the write lock is taken before anything is read, so the seq a writer reads is the
seq it writes), and busy_timeout makes another process wait for the lock instead of failing.
synchronous=FULL: each commit fsyncs the WAL before it returns, so an acknowledged write
survives a power cut too (NORMAL would only survive a process crash, and the contract promises
durable acknowledgements). A commit is one fsync; the store writes a few rows per turn.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from functools import partial
from pathlib import Path
from typing import TypeVar

from tandem.bus.events import FINAL_STATUSES, ReplyStatus, now_ms
from tandem.store import shadow
from tandem.store.base import Conversation, Feedback, Message, NewMessage, Rating, Role, StoreUnavailable
from tandem.store.shadow import ShadowAnswer
from tandem.store.usage import ReplyUsage, UsageRow

T = TypeVar("T")
SCHEMA_VERSION = 3
_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS conversations (
        id TEXT PRIMARY KEY, user_id TEXT NOT NULL, title TEXT NOT NULL, model TEXT NOT NULL,
        created_at_ms INTEGER NOT NULL, updated_at_ms INTEGER NOT NULL,
        summary TEXT NOT NULL DEFAULT '', summary_upto_seq INTEGER NOT NULL DEFAULT 0,
        total_tokens INTEGER NOT NULL DEFAULT 0, last_seq INTEGER NOT NULL DEFAULT 0)""",
    "CREATE INDEX IF NOT EXISTS conversations_by_user ON conversations (user_id, updated_at_ms DESC, id DESC)",
    """CREATE TABLE IF NOT EXISTS messages (
        id TEXT PRIMARY KEY, conversation_id TEXT NOT NULL REFERENCES conversations (id), seq INTEGER NOT NULL,
        parent_seq INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL, tokens INTEGER NOT NULL,
        model TEXT NOT NULL, status TEXT NOT NULL, created_at_ms INTEGER NOT NULL,
        UNIQUE (conversation_id, seq))""",
    # 2: feedback, one rating per answer (replaced when rated again).
    """CREATE TABLE IF NOT EXISTS message_feedback (
        message_id TEXT PRIMARY KEY REFERENCES messages (id), conversation_id TEXT NOT NULL,
        rating TEXT NOT NULL, reason TEXT NOT NULL, comment TEXT NOT NULL, rated_at_ms INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS message_feedback_by_conversation ON message_feedback (conversation_id)",
    # The usage ledger: a row per reply (its id claims it once), summed per user, model and day on
    # read. New tables only: a file from before them gets them at its next start.
    """CREATE TABLE IF NOT EXISTS usage_replies (
        reply_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, model TEXT NOT NULL, day TEXT NOT NULL,
        prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS usage_by_user ON usage_replies (user_id, day)",
    "CREATE INDEX IF NOT EXISTS usage_by_day ON usage_replies (day)",
    # 3: shadow answers, a candidate version's answers to mirrored replies (its reply id claims it once).
    """CREATE TABLE IF NOT EXISTS shadow_answers (
        reply_id TEXT PRIMARY KEY, shadow_of TEXT NOT NULL, user_id TEXT NOT NULL, conversation_id TEXT NOT NULL,
        model TEXT NOT NULL, content TEXT NOT NULL, output_tokens INTEGER NOT NULL, status TEXT NOT NULL, finish TEXT NOT NULL,
        stop_reason TEXT NOT NULL, ttft_s REAL NOT NULL, created_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS shadow_answers_by_reply ON shadow_answers (shadow_of)",
    "CREATE INDEX IF NOT EXISTS shadow_answers_by_conversation ON shadow_answers (conversation_id)",
]
_CONVERSATION_COLUMNS = "id, user_id, title, model, created_at_ms, updated_at_ms, summary, summary_upto_seq, total_tokens"
_MESSAGE_COLUMNS = "id, conversation_id, seq, parent_seq, role, content, tokens, model, status, created_at_ms"
_FEEDBACK_COLUMNS = "message_id, conversation_id, rating, reason, comment, rated_at_ms"
_USAGE_SUMS = "user_id, model, day, count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens)"


def _the_row(db: sqlite3.Connection, sql: str, params: tuple[object, ...] = ()) -> sqlite3.Row:
    """The row a query inside a write transaction must find (one the transaction just wrote)."""
    row = db.execute(sql, params).fetchone()
    if row is None:
        raise StoreUnavailable(f"sqlite: a row this transaction wrote is not there ({sql})")
    return row


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(**{key: row[key] for key in _CONVERSATION_COLUMNS.split(", ")})


def _usage_row(row: sqlite3.Row) -> UsageRow:
    user_id, model, day, messages, prompt_tokens, cached_tokens, completion_tokens = row
    return UsageRow(user_id, model, date.fromisoformat(day), messages, prompt_tokens, cached_tokens, completion_tokens)


def _message(row: sqlite3.Row) -> Message:
    fields = {key: row[key] for key in _MESSAGE_COLUMNS.split(", ")}
    return Message(**fields | {"role": Role(fields["role"]), "status": ReplyStatus(fields["status"])})


def _feedback(row: sqlite3.Row) -> Feedback:
    fields = {key: row[key] for key in _FEEDBACK_COLUMNS.split(", ")}
    return Feedback(**fields | {"rating": Rating(fields["rating"])})


class SqliteStore:
    """Every call is one function on the store's own thread, its whole transaction there: one hop
    off the event loop and back per call, where a statement at a time (aiosqlite's way) took two
    or more per statement and let the loop's other work in between. Under load the hops were the
    cost: in bench/overload.py, with the machine busy, a first message's append and title took many
    times longer at p95 than their writes did. One thread also serializes the
    transactions of this process, so no lock is needed for them."""

    def __init__(self, path: Path, *, timeout_s: float = 5.0) -> None:
        self._path = path
        self._timeout_s = timeout_s
        self._db: sqlite3.Connection | None = None
        self._thread: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        if self._db is not None:
            return
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        try:
            self._db = await asyncio.get_running_loop().run_in_executor(thread, self._open)
        except (OSError, sqlite3.Error) as exc:
            thread.shutdown(wait=False)
            raise StoreUnavailable(f"sqlite {self._path}: {exc}") from None
        except BaseException:
            thread.shutdown(wait=False)
            raise
        self._thread = thread

    def _open(self) -> sqlite3.Connection:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        # Used only on the store's thread (check_same_thread stays on to say so).
        db = sqlite3.connect(self._path, timeout=self._timeout_s, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout = {int(self._timeout_s * 1000)}")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = FULL")
            db.execute("PRAGMA foreign_keys = ON")
            _in_transaction(db, self._migrate)
        except BaseException:
            db.close()
            raise
        return db

    def _migrate(self, db: sqlite3.Connection) -> None:
        version = _the_row(db, "PRAGMA user_version")[0]
        if version > SCHEMA_VERSION:
            raise StoreUnavailable(f"sqlite {self._path}: schema version {version} is newer than this code ({SCHEMA_VERSION})")
        for statement in _SCHEMA:
            db.execute(statement)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    async def close(self) -> None:
        db, thread = self._db, self._thread
        self._db = self._thread = None
        if db is not None and thread is not None:
            await asyncio.get_running_loop().run_in_executor(thread, db.close)
            thread.shutdown(wait=False)

    async def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`work` on the store's thread with its connection."""
        db, thread = self._db, self._thread
        if db is None or thread is None:
            raise StoreUnavailable("sqlite store is not started")
        try:
            return await asyncio.get_running_loop().run_in_executor(thread, work, db)
        except sqlite3.OperationalError as exc:  # locked past busy_timeout, disk full, unreadable file
            raise StoreUnavailable(f"sqlite {self._path}: {exc}") from None

    async def _write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`work` as one short write transaction, holding the file's write lock from its first statement."""
        return await self._call(partial(_in_transaction, work=work))

    async def create_conversation(self, conversation: Conversation) -> Conversation:
        def create(db: sqlite3.Connection) -> sqlite3.Row:
            db.execute(
                f"INSERT OR IGNORE INTO conversations ({_CONVERSATION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    conversation.id,
                    conversation.user_id,
                    conversation.title,
                    conversation.model,
                    conversation.created_at_ms,
                    conversation.updated_at_ms,
                    conversation.summary,
                    conversation.summary_upto_seq,
                    conversation.total_tokens,
                ),
            )
            return _the_row(db, f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ?", (conversation.id,))

        return _conversation(await self._write(create))

    async def get_conversation(self, user_id: str, conversation_id: str) -> Conversation | None:
        query = f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ? AND user_id = ?"
        row = await self._call(lambda db: db.execute(query, (conversation_id, user_id)).fetchone())
        return None if row is None else _conversation(row)

    async def list_conversations(self, user_id: str, *, limit: int = 50, before_ms: int | None = None) -> list[Conversation]:
        query = (
            f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE user_id = ? AND updated_at_ms < ? "
            "ORDER BY updated_at_ms DESC, id DESC LIMIT ?"
        )
        params = (user_id, before_ms if before_ms is not None else 2**62, limit)
        rows = await self._call(lambda db: db.execute(query, params).fetchall())
        return [_conversation(row) for row in rows]

    async def update_conversation(
        self,
        user_id: str,
        conversation_id: str,
        *,
        title: str | None = None,
        summary: str | None = None,
        summary_upto_seq: int | None = None,
    ) -> Conversation | None:
        def update(db: sqlite3.Connection) -> sqlite3.Row | None:
            db.execute(
                "UPDATE conversations SET title = coalesce(?, title), summary = coalesce(?, summary), "
                "summary_upto_seq = coalesce(?, summary_upto_seq) WHERE id = ? AND user_id = ?",
                (title, summary, summary_upto_seq, conversation_id, user_id),
            )
            query = f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ? AND user_id = ?"
            return db.execute(query, (conversation_id, user_id)).fetchone()

        row = await self._write(update)
        return None if row is None else _conversation(row)

    async def delete_conversation(self, user_id: str, conversation_id: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            owned = db.execute("SELECT 1 FROM conversations WHERE id = ? AND user_id = ?", (conversation_id, user_id)).fetchone()
            if owned is None:
                return False
            db.execute("DELETE FROM message_feedback WHERE conversation_id = ?", (conversation_id,))
            db.execute("DELETE FROM shadow_answers WHERE conversation_id = ?", (conversation_id,))
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            return True

        return await self._write(delete)

    async def append_message(self, user_id: str, message: NewMessage, *, title: str | None = None) -> Message:
        def append(db: sqlite3.Connection) -> sqlite3.Row:
            owner = db.execute(
                "SELECT last_seq FROM conversations WHERE id = ? AND user_id = ?", (message.conversation_id, user_id)
            ).fetchone()
            if owner is None:
                raise KeyError(message.conversation_id)
            stored = db.execute(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message.id,)).fetchone()
            if stored is not None and stored["conversation_id"] != message.conversation_id:
                raise ValueError(f"message id {message.id!r} belongs to another conversation")
            if stored is not None:
                return stored
            seq = owner["last_seq"] + 1
            created_at_ms = message.created_at_ms or now_ms()
            db.execute(
                f"INSERT INTO messages ({_MESSAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    message.id,
                    message.conversation_id,
                    seq,
                    message.parent_seq,
                    message.role.value,
                    message.content,
                    message.tokens,
                    message.model,
                    message.status.value,
                    created_at_ms,
                ),
            )
            db.execute(
                "UPDATE conversations SET last_seq = ?, total_tokens = total_tokens + ?, updated_at_ms = max(updated_at_ms, ?), "
                "title = coalesce(?, title) WHERE id = ?",
                (seq, message.tokens, now_ms(), title, message.conversation_id),
            )
            return _the_row(db, f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message.id,))

        return _message(await self._write(append))

    async def finish_message(
        self, conversation_id: str, message_id: str, *, content: str, status: ReplyStatus, tokens: int, model: str = ""
    ) -> Message | None:
        if status not in FINAL_STATUSES:
            raise ValueError(f"{status.value} is not a final status")
        query = f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ? AND conversation_id = ?"

        def finish(db: sqlite3.Connection) -> sqlite3.Row | None:
            row = db.execute(query, (message_id, conversation_id)).fetchone()
            if row is None or ReplyStatus(row["status"]) in FINAL_STATUSES:
                return row
            db.execute(
                "UPDATE messages SET content = ?, status = ?, tokens = ?, model = ? WHERE id = ?",
                (content, status.value, tokens, model or row["model"], message_id),
            )
            db.execute("UPDATE conversations SET total_tokens = total_tokens + ? WHERE id = ?", (tokens - row["tokens"], conversation_id))
            return _the_row(db, query, (message_id, conversation_id))

        row = await self._write(finish)
        return None if row is None else _message(row)

    async def get_message(self, message_id: str) -> Message | None:
        query = f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE id = ?"
        row = await self._call(lambda db: db.execute(query, (message_id,)).fetchone())
        return None if row is None else _message(row)

    async def list_messages(self, conversation_id: str, *, after_seq: int = 0, limit: int | None = None) -> list[Message]:
        query = f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? AND seq > ? ORDER BY seq LIMIT ?"
        params = (conversation_id, after_seq, -1 if limit is None else limit)
        rows = await self._call(lambda db: db.execute(query, params).fetchall())
        return [_message(row) for row in rows]

    # --- feedback

    async def rate_message(self, feedback: Feedback) -> Feedback | None:
        f = feedback

        def rate(db: sqlite3.Connection) -> sqlite3.Row | None:
            if (
                db.execute("SELECT 1 FROM messages WHERE id = ? AND conversation_id = ?", (f.message_id, f.conversation_id)).fetchone()
                is None
            ):
                raise KeyError(f.message_id)
            before = db.execute(f"SELECT {_FEEDBACK_COLUMNS} FROM message_feedback WHERE message_id = ?", (f.message_id,)).fetchone()
            db.execute(
                f"INSERT OR REPLACE INTO message_feedback ({_FEEDBACK_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                (f.message_id, f.conversation_id, f.rating.value, f.reason, f.comment, f.rated_at_ms or now_ms()),
            )
            return before

        before = await self._write(rate)
        return None if before is None else _feedback(before)

    async def list_feedback(self, conversation_id: str) -> list[Feedback]:
        query = f"SELECT {_FEEDBACK_COLUMNS} FROM message_feedback WHERE conversation_id = ?"
        rows = await self._call(lambda db: db.execute(query, (conversation_id,)).fetchall())
        return [_feedback(row) for row in rows]

    async def record_usage(self, usage: ReplyUsage) -> None:
        statement = (
            "INSERT OR IGNORE INTO usage_replies (reply_id, user_id, model, day, prompt_tokens, cached_tokens, completion_tokens) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)"
        )
        params = (
            usage.reply_id,
            usage.user_id,
            usage.model,
            usage.day.isoformat(),
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
        )
        await self._write(lambda db: db.execute(statement, params))

    async def usage_of(self, user_id: str, *, since: date) -> list[UsageRow]:
        query = f"SELECT {_USAGE_SUMS} FROM usage_replies WHERE user_id = ? AND day >= ? GROUP BY day, model ORDER BY day, model"
        rows = await self._call(lambda db: db.execute(query, (user_id, since.isoformat())).fetchall())
        return [_usage_row(row) for row in rows]

    async def usage_since(self, since: date) -> list[UsageRow]:
        query = f"SELECT {_USAGE_SUMS} FROM usage_replies WHERE day >= ? GROUP BY day, user_id, model ORDER BY day, user_id, model"
        rows = await self._call(lambda db: db.execute(query, (since.isoformat(),)).fetchall())
        return [_usage_row(row) for row in rows]

    # --- shadow answers

    async def record_shadow_answer(self, answer: ShadowAnswer) -> None:
        statement = f"INSERT OR IGNORE INTO shadow_answers ({shadow.COLUMNS}) VALUES ({shadow.PLACEHOLDERS})"
        await self._write(lambda db: db.execute(statement, shadow.as_row(answer)))

    async def shadow_answers(self, shadow_of: str) -> list[ShadowAnswer]:
        query = f"SELECT {shadow.COLUMNS} FROM shadow_answers WHERE shadow_of = ?"
        rows = await self._call(lambda db: db.execute(query, (shadow_of,)).fetchall())
        return shadow.in_order([shadow.from_row(row) for row in rows])


def _in_transaction(db: sqlite3.Connection, work: Callable[[sqlite3.Connection], T]) -> T:
    db.execute("BEGIN IMMEDIATE")
    try:
        result = work(db)
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return result
