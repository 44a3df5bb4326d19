"""The production conversation store on Cassandra: the queries of the contract (base.py).

Data model (keyspace from settings, schema version in `schema_version`, tables in
cassandra_schema.py):
- conversations (id) - the source of truth for a conversation; `token_counts` maps seq -> tokens
  (set per message, so two writers never lose each other's count; total_tokens is the sum) and
  `last_seq` is a hint where the next seq search starts.
- conversations_by_user ((user_id), updated_at_ms DESC, conversation_id) - the newest-first list.
  updated_at_ms moves on every append: delete + insert in one logged batch. Two writers racing can
  leave an entry behind; list_conversations keeps an entry only when it equals the conversation's
  updated_at_ms, so a left-behind (or resurrected) entry is never shown.
- messages ((conversation_id, bucket), seq) - bucket = (seq - 1) // bucket_size bounds partitions.
  A seq is taken with INSERT ... IF NOT EXISTS (Paxos), so two writers never share one; a writer
  that loses tries the next seq. Seqs are taken in order, so they stay contiguous.
- messages_by_id (id) -> (conversation_id, seq) - get by id, and the idempotency claim: a retried
  append finds its id here (or, after a crash mid-append, meets its own row while searching for
  a seq) and returns the stored message instead of writing a second one.
- message_feedback ((conversation_id), message_id) - an answer's rating, replaced when rated
  again; a conversation's ratings are one partition, read beside its messages.

- usage_by_user, usage_by_day - the usage ledger, a row per reply (cassandra_usage.py).
- shadow_answers ((shadow_of), reply_id) - a candidate version's answers to a mirrored reply,
  written with a plain INSERT (a rewrite is the same row); deleted with the conversation's
  messages, by their ids (a product reply's id is its message's).

Every driver request is bounded by timeout_s (cassandra_session.py) and so is every store call;
driver errors become StoreUnavailable.

Durability: a write is acknowledged by `consistency` replicas (LOCAL_QUORUM: two of three in a
cluster). A single node keeps acknowledged writes through a crash only with
`commitlog_sync: batch` (tandem.devstack.cassandra_node sets it); with the default "periodic" a killed
node replays nothing written after its last sync, so fresh acknowledged rows can be lost.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Awaitable, Callable, Coroutine
from datetime import date, timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar

from cassandra.query import BatchStatement, BatchType

from tandem.bus.events import FINAL_STATUSES, ReplyStatus, now_ms
from tandem.store import cassandra_usage, shadow
from tandem.store.base import Conversation, Feedback, Message, NewMessage, StoreUnavailable
from tandem.store.cassandra_schema import (
    DEFAULT_BUCKET_SIZE,
    MESSAGE_COLUMNS,
    QUERIES,
    check_schema,
    conversation_from_row,
    feedback_from_row,
    in_keyspace,
    message_from_row,
    shadow_answer_from_row,
)
from tandem.store.cassandra_session import CassandraSession
from tandem.store.shadow import ShadowAnswer
from tandem.store.usage import ReplyUsage, UsageRow, today_utc

_MAX_SEQ_ATTEMPTS = 1000
_KEYSPACE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,47}$")

T = TypeVar("T")
P = ParamSpec("P")


def _bounded(
    method: Callable[Concatenate[CassandraStore, P], Awaitable[T]],
) -> Callable[Concatenate[CassandraStore, P], Coroutine[Any, Any, T]]:
    """The whole store call, not only each request, ends within timeout_s."""

    @functools.wraps(method)
    async def call(self: CassandraStore, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await asyncio.wait_for(method(self, *args, **kwargs), self._timeout_s)
        except TimeoutError:
            raise StoreUnavailable(f"cassandra {self._hosts}: {method.__name__} took longer than {self._timeout_s} s") from None

    return call


class CassandraStore:
    def __init__(
        self,
        hosts: str,
        *,
        keyspace: str = "tandem",
        consistency: str = "LOCAL_QUORUM",
        timeout_s: float = 5.0,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        username: str = "",
        password: str = "",
        ca_file: str = "",
    ) -> None:
        """`username`: log in with it and `password` (the node's PasswordAuthenticator); empty: no login.
        `ca_file`: TLS to the nodes, verified against that CA (CassandraSession); empty: in clear."""
        if not _KEYSPACE.match(keyspace):
            raise ValueError(f"{keyspace!r} is not a keyspace name (letters, digits, _)")
        self._hosts = hosts
        self._session = CassandraSession(
            hosts, consistency=consistency, timeout_s=timeout_s, username=username, password=password, ca_file=ca_file
        )
        self._keyspace = keyspace
        self._timeout_s = timeout_s
        self._bucket_size = bucket_size

    async def start(self) -> None:
        """Connects, checks the schema (`tandem store migrate` makes it: the service's role may not),
        and prepares the queries."""
        if self._session.is_connected:
            return
        await self._session.connect()
        try:
            await check_schema(self._session, self._keyspace, self._bucket_size)
            await self._session.prepare({name: in_keyspace(query, self._keyspace) for name, query in QUERIES.items()})
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        await self._session.close()

    def _bucket(self, seq: int) -> int:
        return (seq - 1) // self._bucket_size

    # --- conversations

    async def _conversation_row(self, conversation_id: str) -> dict[str, Any] | None:
        rows = (await self._session.run("get_conversation", conversation_id)).current_rows
        return rows[0] if rows else None

    @_bounded
    async def create_conversation(self, conversation: Conversation) -> Conversation:
        c = conversation
        result = await self._session.run(
            "create_conversation",
            c.id,
            c.user_id,
            c.title,
            c.model,
            c.created_at_ms,
            c.updated_at_ms,
            c.summary,
            c.summary_upto_seq,
            {0: c.total_tokens} if c.total_tokens else None,
            0,
        )
        row = result.current_rows[0] if not result.was_applied else await self._conversation_row(c.id)
        if row is None:  # written at the configured consistency, but a read did not see it yet
            raise StoreUnavailable(f"cassandra {self._hosts}: conversation {c.id} was written but is not readable yet; retry")
        stored = conversation_from_row(row)
        # Idempotent: a retry after a crash between the two writes still lists the conversation.
        await self._session.run("index_insert", stored.user_id, stored.updated_at_ms, stored.id)
        return stored

    @_bounded
    async def get_conversation(self, user_id: str, conversation_id: str) -> Conversation | None:
        row = await self._conversation_row(conversation_id)
        return conversation_from_row(row) if row is not None and row["user_id"] == user_id else None

    @_bounded
    async def list_conversations(self, user_id: str, *, limit: int = 50, before_ms: int | None = None) -> list[Conversation]:
        found: list[Conversation] = []
        seen: set[str] = set()
        entries = self._session.pages("index_page", (user_id, before_ms if before_ms is not None else 2**62), page_size=limit + 10)
        batch: list[dict[str, Any]] = []
        async for entry in entries:
            batch.append(entry)
            if len(batch) < limit - len(found):
                continue
            found += await self._current(user_id, batch, seen)
            batch = []
            if len(found) >= limit:
                break
        found += await self._current(user_id, batch, seen)
        return found[:limit]

    async def _current(self, user_id: str, entries: list[dict[str, Any]], seen: set[str]) -> list[Conversation]:
        """The conversations these index entries point at, skipping entries left behind."""
        rows = await asyncio.gather(*(self._conversation_row(e["conversation_id"]) for e in entries))
        current = []
        for entry, row in zip(entries, rows):
            if row is None or row["user_id"] != user_id or row["updated_at_ms"] != entry["updated_at_ms"] or row["id"] in seen:
                continue
            seen.add(row["id"])
            current.append(conversation_from_row(row))
        return current

    @_bounded
    async def update_conversation(
        self,
        user_id: str,
        conversation_id: str,
        *,
        title: str | None = None,
        summary: str | None = None,
        summary_upto_seq: int | None = None,
    ) -> Conversation | None:
        row = await self._conversation_row(conversation_id)
        if row is None or row["user_id"] != user_id:
            return None
        # Only the fields given are written, so two updaters of different fields never undo each other.
        if title is not None:
            await self._session.run("set_title", title, conversation_id)
            row["title"] = title
        if summary is not None or summary_upto_seq is not None:
            row["summary"] = row["summary"] if summary is None else summary
            row["summary_upto_seq"] = row["summary_upto_seq"] if summary_upto_seq is None else summary_upto_seq
            await self._session.run("set_summary", row["summary"], row["summary_upto_seq"], conversation_id)
        return conversation_from_row(row)

    @_bounded
    async def delete_conversation(self, user_id: str, conversation_id: str) -> bool:
        row = await self._conversation_row(conversation_id)
        if row is None or row["user_id"] != user_id:
            return False
        # Messages (and their ratings) first, the conversation last: a delete cut short leaves the
        # conversation to delete again, never messages that nothing points at.
        await self._session.run("delete_feedback", conversation_id)
        bucket = 0
        while ids := [r["id"] async for r in self._session.pages("message_ids", (conversation_id, bucket), page_size=500)]:
            await asyncio.gather(
                *(self._session.run("delete_id", message_id) for message_id in ids),
                *(self._session.run("delete_shadow_answers", message_id) for message_id in ids),
            )
            await self._session.run("delete_bucket", conversation_id, bucket)
            bucket += 1  # seqs are contiguous: the first empty bucket is the last
        await self._session.run("index_delete", user_id, row["updated_at_ms"], conversation_id)
        await self._session.run("delete_conversation", conversation_id)
        return True

    # --- messages

    @_bounded
    async def append_message(self, user_id: str, message: NewMessage, *, title: str | None = None) -> Message:
        conversation = await self._conversation_row(message.conversation_id)
        if conversation is None or conversation["user_id"] != user_id:
            raise KeyError(message.conversation_id)
        claim = await self._session.run("claim_id", message.id, message.conversation_id)
        if not claim.was_applied:
            claimed = claim.current_rows[0]
            if claimed["conversation_id"] != message.conversation_id:
                raise ValueError(f"message id {message.id!r} belongs to another conversation")
            if claimed["seq"] is not None and (stored := await self._message_at(message.conversation_id, claimed["seq"])) is not None:
                return stored
        seq, row = await self._take_seq(message, (conversation["last_seq"] or 0) + 1)
        updated_at_ms = max(now_ms(), conversation["updated_at_ms"] + 1)
        # One logged batch: the id's seq, the conversation's counters and its place in the user's list.
        batch = BatchStatement(batch_type=BatchType.LOGGED)
        batch.add(self._session.prepared("set_id_seq"), (seq, message.id))
        batch.add(self._session.prepared("bump_conversation"), (seq, seq, row["tokens"], updated_at_ms, message.conversation_id))
        batch.add(self._session.prepared("index_delete"), (user_id, conversation["updated_at_ms"], message.conversation_id))
        batch.add(self._session.prepared("index_insert"), (user_id, updated_at_ms, message.conversation_id))
        if title is not None:
            batch.add(self._session.prepared("set_title"), (title, message.conversation_id))
        await self._session.execute(batch, None)
        return message_from_row(row)

    async def _take_seq(self, message: NewMessage, seq: int) -> tuple[int, dict[str, Any]]:
        """The first free seq from `seq` on, taken with a Paxos insert; or the seq an earlier try
        of this same message already took (it is met on the way: seqs are taken in order)."""
        m = message
        created_at_ms = m.created_at_ms or now_ms()
        for _ in range(_MAX_SEQ_ATTEMPTS):
            values = (m.id, m.conversation_id, seq, m.parent_seq, m.role.value, m.content, m.tokens, m.model, m.status.value, created_at_ms)
            result = await self._session.run("claim_seq", *values, self._bucket(seq))
            if result.was_applied:
                return seq, dict(zip(MESSAGE_COLUMNS.split(", "), values))
            if result.current_rows[0]["id"] == m.id:
                return seq, result.current_rows[0]
            seq += 1
        raise StoreUnavailable(f"cassandra {self._hosts}: no free seq in conversation {m.conversation_id} after {_MAX_SEQ_ATTEMPTS} tries")

    async def _message_at(self, conversation_id: str, seq: int) -> Message | None:
        rows = (await self._session.run("get_message", conversation_id, self._bucket(seq), seq)).current_rows
        return message_from_row(rows[0]) if rows else None

    @_bounded
    async def finish_message(
        self, conversation_id: str, message_id: str, *, content: str, status: ReplyStatus, tokens: int, model: str = ""
    ) -> Message | None:
        if status not in FINAL_STATUSES:
            raise ValueError(f"{status.value} is not a final status")
        rows = (await self._session.run("get_id", message_id)).current_rows
        if not rows or rows[0]["conversation_id"] != conversation_id or rows[0]["seq"] is None:
            return None
        seq = rows[0]["seq"]
        if model:
            await self._session.run("finish_model", content, status.value, tokens, model, conversation_id, self._bucket(seq), seq)
        else:
            await self._session.run("finish", content, status.value, tokens, conversation_id, self._bucket(seq), seq)
        # Applied or not (the first final write wins), the stored row is the answer; counting its
        # tokens again is idempotent and repairs a count that a crash right here left behind.
        stored = await self._message_at(conversation_id, seq)
        if stored is None:
            return None
        await self._session.run("count_tokens", seq, stored.tokens, conversation_id)
        return stored

    @_bounded
    async def get_message(self, message_id: str) -> Message | None:
        rows = (await self._session.run("get_id", message_id)).current_rows
        if not rows or rows[0]["seq"] is None:
            return None
        return await self._message_at(rows[0]["conversation_id"], rows[0]["seq"])

    @_bounded
    async def list_messages(self, conversation_id: str, *, after_seq: int = 0, limit: int | None = None) -> list[Message]:
        found: list[Message] = []
        bucket = self._bucket(after_seq + 1)
        while limit is None or len(found) < limit:
            page_size = 100 if limit is None else min(100, limit - len(found))
            num_before = len(found)
            async for row in self._session.pages("messages_after", (conversation_id, bucket, after_seq), page_size):
                found.append(message_from_row(row))
                if limit is not None and len(found) >= limit:
                    break
            if len(found) == num_before:
                break  # an empty bucket: seqs are contiguous, so no later bucket has any
            bucket += 1
        return found

    # --- feedback

    @_bounded
    async def rate_message(self, feedback: Feedback) -> Feedback | None:
        f = feedback
        rows = (await self._session.run("get_id", f.message_id)).current_rows
        if not rows or rows[0]["conversation_id"] != f.conversation_id or rows[0]["seq"] is None:
            raise KeyError(f.message_id)
        # Read, then write: two ratings racing both return the one before them (the last write stays).
        before = (await self._session.run("get_feedback", f.conversation_id, f.message_id)).current_rows
        values = (f.conversation_id, f.message_id, f.rating.value, f.reason, f.comment, f.rated_at_ms or now_ms())
        await self._session.run("set_feedback", *values)
        return feedback_from_row(before[0]) if before else None

    @_bounded
    async def list_feedback(self, conversation_id: str) -> list[Feedback]:
        return [feedback_from_row(row) async for row in self._session.pages("feedback_of", (conversation_id,), page_size=500)]

    # --- the usage ledger

    @_bounded
    async def record_usage(self, usage: ReplyUsage) -> None:
        await cassandra_usage.record(self._session, usage)

    @_bounded
    async def usage_of(self, user_id: str, *, since: date) -> list[UsageRow]:
        return await cassandra_usage.of_user(self._session, user_id, since, _last_day_written())

    async def usage_since(self, since: date) -> list[UsageRow]:
        """Each request bounded by timeout_s, not the whole read: an export reads every day's rows."""
        return await cassandra_usage.every_user(self._session, since, _last_day_written())

    # --- shadow answers

    @_bounded
    async def record_shadow_answer(self, answer: ShadowAnswer) -> None:
        await self._session.run("set_shadow_answer", *shadow.as_row(answer))

    @_bounded
    async def shadow_answers(self, shadow_of: str) -> list[ShadowAnswer]:
        rows = self._session.pages("shadow_answers_of", (shadow_of,), page_size=100)
        return shadow.in_order([shadow_answer_from_row(row) async for row in rows])


def _last_day_written() -> date:
    """The last day a reply's usage can be on: tomorrow (UTC), for a writer whose clock runs ahead."""
    return today_utc() + timedelta(days=1)
