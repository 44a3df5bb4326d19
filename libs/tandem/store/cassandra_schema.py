"""The Cassandra store's tables, their migrations, and the statements it prepares.

The schema version and the message bucket size live in `schema_version`; a keyspace made by
newer code, or with another bucket size, is refused rather than written.
"""

from __future__ import annotations

import re
from typing import Any

from cassandra import InvalidRequest, Unauthorized

from tandem.bus.events import ReplyStatus, now_ms
from tandem.errors import StartupError
from tandem.store import shadow
from tandem.store.base import Conversation, Feedback, Message, Rating, Role, StoreUnavailable
from tandem.store.cassandra_session import DDL_TIMEOUT_S, CassandraSession
from tandem.store.shadow import ShadowAnswer

SCHEMA_VERSION = 4
DEFAULT_BUCKET_SIZE = 1000

MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE IF NOT EXISTS conversations (
            id text PRIMARY KEY, user_id text, title text, model text, created_at_ms bigint, updated_at_ms bigint,
            summary text, summary_upto_seq int, token_counts map<int, int>, last_seq int)""",
        # Left-behind entries are filtered on read, so a short gc_grace only risks harmless ones.
        """CREATE TABLE IF NOT EXISTS conversations_by_user (
            user_id text, updated_at_ms bigint, conversation_id text,
            PRIMARY KEY ((user_id), updated_at_ms, conversation_id))
            WITH CLUSTERING ORDER BY (updated_at_ms DESC, conversation_id DESC) AND gc_grace_seconds = 3600""",
        """CREATE TABLE IF NOT EXISTS messages (
            conversation_id text, bucket int, seq int, id text, parent_seq int, role text, content text,
            tokens int, model text, status text, created_at_ms bigint,
            PRIMARY KEY ((conversation_id, bucket), seq)) WITH CLUSTERING ORDER BY (seq ASC)""",
        "CREATE TABLE IF NOT EXISTS messages_by_id (id text PRIMARY KEY, conversation_id text, seq int)",
    ],
    # Feedback: one rating per answer, a conversation's ratings in one partition (read with its messages).
    2: [
        """CREATE TABLE IF NOT EXISTS message_feedback (
            conversation_id text, message_id text, rating text, reason text, comment text, rated_at_ms bigint,
            PRIMARY KEY ((conversation_id), message_id))""",
    ],
    # The usage ledger (cassandra_usage.py): a row per reply, by user and month, and by day for the
    # export. Written with plain INSERTs, so a repeated write of a reply is the same row again.
    3: [
        """CREATE TABLE IF NOT EXISTS usage_by_user (
            user_id text, month text, day text, model text, reply_id text,
            prompt_tokens bigint, cached_tokens bigint, completion_tokens bigint,
            PRIMARY KEY ((user_id, month), day, model, reply_id))""",
        """CREATE TABLE IF NOT EXISTS usage_by_day (
            day text, shard int, user_id text, model text, reply_id text,
            prompt_tokens bigint, cached_tokens bigint, completion_tokens bigint,
            PRIMARY KEY ((day, shard), user_id, model, reply_id))""",
    ],
    # Shadow answers: a candidate version's answers to one mirrored reply, one partition per
    # mirrored reply (read together, deleted with the conversation's messages by their ids).
    4: [
        """CREATE TABLE IF NOT EXISTS shadow_answers (
            shadow_of text, reply_id text, user_id text, conversation_id text, model text, content text,
            output_tokens int, status text, finish text, stop_reason text, ttft_s double, created_ms bigint, finished_ms bigint,
            PRIMARY KEY ((shadow_of), reply_id))""",
    ],
}
MESSAGE_COLUMNS = "id, conversation_id, seq, parent_seq, role, content, tokens, model, status, created_at_ms"
FEEDBACK_COLUMNS = "conversation_id, message_id, rating, reason, comment, rated_at_ms"
_CONVERSATION_COLUMNS = "id, user_id, title, model, created_at_ms, updated_at_ms, summary, summary_upto_seq, token_counts, last_seq"
QUERIES = {
    "get_conversation": f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ?",
    "create_conversation": f"INSERT INTO conversations ({_CONVERSATION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS",
    "set_title": "UPDATE conversations SET title = ? WHERE id = ?",
    "set_summary": "UPDATE conversations SET summary = ?, summary_upto_seq = ? WHERE id = ?",
    "count_tokens": "UPDATE conversations SET token_counts[?] = ? WHERE id = ?",
    "bump_conversation": "UPDATE conversations SET last_seq = ?, token_counts[?] = ?, updated_at_ms = ? WHERE id = ?",
    "index_insert": "INSERT INTO conversations_by_user (user_id, updated_at_ms, conversation_id) VALUES (?, ?, ?)",
    "index_delete": "DELETE FROM conversations_by_user WHERE user_id = ? AND updated_at_ms = ? AND conversation_id = ?",
    "index_page": "SELECT updated_at_ms, conversation_id FROM conversations_by_user WHERE user_id = ? AND updated_at_ms < ?",
    "claim_id": "INSERT INTO messages_by_id (id, conversation_id) VALUES (?, ?) IF NOT EXISTS",
    "set_id_seq": "UPDATE messages_by_id SET seq = ? WHERE id = ?",
    "get_id": "SELECT conversation_id, seq FROM messages_by_id WHERE id = ?",
    "claim_seq": f"INSERT INTO messages ({MESSAGE_COLUMNS}, bucket) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS",
    "finish": "UPDATE messages SET content = ?, status = ?, tokens = ? WHERE conversation_id = ? AND bucket = ? AND seq = ? IF status = 'running'",
    "finish_model": "UPDATE messages SET content = ?, status = ?, tokens = ?, model = ? "
    "WHERE conversation_id = ? AND bucket = ? AND seq = ? IF status = 'running'",
    "get_message": f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? AND bucket = ? AND seq = ?",
    "messages_after": f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? AND bucket = ? AND seq > ?",
    "message_ids": "SELECT id FROM messages WHERE conversation_id = ? AND bucket = ?",
    "delete_bucket": "DELETE FROM messages WHERE conversation_id = ? AND bucket = ?",
    "delete_id": "DELETE FROM messages_by_id WHERE id = ?",
    "delete_conversation": "DELETE FROM conversations WHERE id = ?",
    # feedback
    "get_feedback": f"SELECT {FEEDBACK_COLUMNS} FROM message_feedback WHERE conversation_id = ? AND message_id = ?",
    "set_feedback": f"INSERT INTO message_feedback ({FEEDBACK_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
    "feedback_of": f"SELECT {FEEDBACK_COLUMNS} FROM message_feedback WHERE conversation_id = ?",
    "delete_feedback": "DELETE FROM message_feedback WHERE conversation_id = ?",
    "usage_by_user": "INSERT INTO usage_by_user (user_id, month, day, model, reply_id, prompt_tokens, cached_tokens, completion_tokens) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    "usage_by_day": "INSERT INTO usage_by_day (day, shard, user_id, model, reply_id, prompt_tokens, cached_tokens, completion_tokens) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    "usage_of_user": "SELECT day, model, reply_id, prompt_tokens, cached_tokens, completion_tokens FROM usage_by_user "
    "WHERE user_id = ? AND month = ? AND day >= ?",
    "usage_of_day": "SELECT user_id, model, reply_id, prompt_tokens, cached_tokens, completion_tokens FROM usage_by_day "
    "WHERE day = ? AND shard = ?",
    # shadow answers
    "set_shadow_answer": f"INSERT INTO shadow_answers ({shadow.COLUMNS}) VALUES ({shadow.PLACEHOLDERS})",
    "shadow_answers_of": f"SELECT {shadow.COLUMNS} FROM shadow_answers WHERE shadow_of = ?",
    "delete_shadow_answers": "DELETE FROM shadow_answers WHERE shadow_of = ?",
}
_GET_SCHEMA = "SELECT version, bucket_size FROM {ks}.schema_version WHERE component = 'conversations'"
_SET_SCHEMA = "INSERT INTO {ks}.schema_version (component, version, bucket_size, applied_at_ms) VALUES ('conversations', %s, %s, %s)"


def in_keyspace(query: str, keyspace: str) -> str:
    """The query with its table named as keyspace.table: Cassandra warns about prepared
    statements that rely on a session keyspace (USE)."""
    return re.sub(r"\b(FROM|INTO|UPDATE) (?=[a-z_]+\b)", rf"\1 {keyspace}.", query)


async def check_schema(session: CassandraSession, keyspace: str, bucket_size: int) -> None:
    """What a service checks at start, as the application role, which may change no schema: the
    keyspace is at SCHEMA_VERSION with `bucket_size`; else a StartupError naming the admin step."""
    try:
        rows = (await session.execute(_GET_SCHEMA.format(ks=keyspace), ())).current_rows
    except (InvalidRequest, Unauthorized) as exc:
        reason = "may not be read by this login" if isinstance(exc, Unauthorized) else "does not exist"
        raise StartupError(
            f"cassandra keyspace {keyspace} {reason}: run `tandem store migrate` with the admin's login (it creates the keyspace "
            "and grants the application role)"
        ) from None
    version, stored_bucket_size = (rows[0]["version"], rows[0]["bucket_size"]) if rows else (0, bucket_size)
    if version > SCHEMA_VERSION:
        raise StoreUnavailable(f"cassandra keyspace {keyspace} has schema version {version}, newer than this code ({SCHEMA_VERSION})")
    if version < SCHEMA_VERSION:
        raise StartupError(
            f"cassandra keyspace {keyspace} has schema version {version}, this code needs {SCHEMA_VERSION}: run `tandem store migrate`"
        )
    if stored_bucket_size != bucket_size:
        raise ValueError(f"keyspace {keyspace} buckets messages by {stored_bucket_size}, not {bucket_size}: it cannot change")


async def migrate(session: CassandraSession, keyspace: str, replication: str, bucket_size: int) -> None:
    """The admin's step (`tandem store migrate`): creates the keyspace and brings its tables up to
    SCHEMA_VERSION, one recorded step at a time."""
    ks = keyspace
    await _ddl(session, f"CREATE KEYSPACE IF NOT EXISTS {ks} WITH replication = {replication}")
    await _ddl(
        session,
        f"CREATE TABLE IF NOT EXISTS {ks}.schema_version (component text PRIMARY KEY, version int, bucket_size int, applied_at_ms bigint)",
    )
    # No `USE`: statements name their keyspace (Cassandra warns about USE with prepared statements).
    rows = (await session.execute(_GET_SCHEMA.format(ks=ks), ())).current_rows
    version, stored_bucket_size = (rows[0]["version"], rows[0]["bucket_size"]) if rows else (0, bucket_size)
    if version > SCHEMA_VERSION:
        raise StoreUnavailable(f"cassandra keyspace {ks} has schema version {version}, newer than this code ({SCHEMA_VERSION})")
    if stored_bucket_size != bucket_size:
        raise ValueError(f"keyspace {ks} buckets messages by {stored_bucket_size}, not {bucket_size}: it cannot change")
    for step in range(version + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS[step]:
            await _ddl(session, statement.replace("CREATE TABLE IF NOT EXISTS ", f"CREATE TABLE IF NOT EXISTS {ks}.", 1))
        await session.execute(_SET_SCHEMA.format(ks=ks), (step, bucket_size, now_ms()))


async def _ddl(session: CassandraSession, statement: str) -> None:
    await session.execute(statement, (), timeout_s=DDL_TIMEOUT_S)


def message_from_row(row: dict[str, Any]) -> Message:
    fields = {key: row[key] for key in MESSAGE_COLUMNS.split(", ")}
    return Message(**fields | {"role": Role(fields["role"]), "status": ReplyStatus(fields["status"])})


def conversation_from_row(row: dict[str, Any]) -> Conversation:
    fields = {key: row[key] for key in _CONVERSATION_COLUMNS.split(", ")[:-2]}
    return Conversation(**fields, total_tokens=sum((row["token_counts"] or {}).values()))


def feedback_from_row(row: dict[str, Any]) -> Feedback:
    fields = {key: row[key] for key in FEEDBACK_COLUMNS.split(", ")}
    return Feedback(**fields | {"rating": Rating(fields["rating"])})


def shadow_answer_from_row(row: dict[str, Any]) -> ShadowAnswer:
    return shadow.from_row([row[key] for key in shadow.COLUMNS.split(", ")])
