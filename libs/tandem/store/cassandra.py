"""The production conversation store on Cassandra (cassandra-driver, protocol v5).

Data model (keyspace from settings, schema version in `schema_version`):
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

Every driver request is bounded by timeout_s and so is every store call; driver errors become
StoreUnavailable. The driver reconnects by itself (ExponentialReconnectionPolicy, 0.5-5 s).
Reactor: libev (the driver's C loop, in its wheel), else the driver's asyncio reactor.

Durability: a write is acknowledged by `consistency` replicas (LOCAL_QUORUM: two of three in a
cluster). A single node keeps acknowledged writes through a crash only with
`commitlog_sync: batch` (tandem.devstack.cassandra_node sets it); with the default "periodic" a killed
node replays nothing written after its last sync (seen here: 3 of 50 fresh rows lost).
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from cassandra import ConsistencyLevel, OperationTimedOut, RequestExecutionException
from cassandra.auth import PlainTextAuthProvider
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, NoHostAvailable, ResponseFuture, ResultSet, Session
from cassandra.connection import ConnectionException, DefaultEndPoint
from cassandra.policies import DCAwareRoundRobinPolicy, ExponentialReconnectionPolicy, TokenAwarePolicy
from cassandra.protocol import IsBootstrappingErrorMessage, OverloadedErrorMessage
from cassandra.query import BatchStatement, BatchType, PreparedStatement, dict_factory

from tandem.bus.events import FINAL_STATUSES, ReplyStatus, now_ms
from tandem.store.base import Conversation, Message, NewMessage, Role, StoreUnavailable

try:  # libev: the driver's C event loop (bundled in the wheel); asyncore is gone from Python 3.12
    from cassandra.io.libevreactor import LibevConnection as _Connection
except ImportError:  # pragma: no cover - a driver built without libev
    from cassandra.io.asyncioreactor import AsyncioConnection as _Connection

SCHEMA_VERSION = 1
DEFAULT_BUCKET_SIZE = 1000
_DDL_TIMEOUT_S = 30.0  # schema changes wait for the cluster's agreement
_MAX_SEQ_ATTEMPTS = 1000
_DRIVER_ERRORS = (
    NoHostAvailable,
    OperationTimedOut,
    RequestExecutionException,
    ConnectionException,
    OverloadedErrorMessage,
    IsBootstrappingErrorMessage,
)
_KEYSPACE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,47}$")

_MIGRATIONS: dict[int, list[str]] = {
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
}
_MESSAGE_COLUMNS = "id, conversation_id, seq, parent_seq, role, content, tokens, model, status, created_at_ms"
_CONVERSATION_COLUMNS = "id, user_id, title, model, created_at_ms, updated_at_ms, summary, summary_upto_seq, token_counts, last_seq"
_QUERIES = {
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
    "claim_seq": f"INSERT INTO messages ({_MESSAGE_COLUMNS}, bucket) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) IF NOT EXISTS",
    "finish": "UPDATE messages SET content = ?, status = ?, tokens = ? WHERE conversation_id = ? AND bucket = ? AND seq = ? IF status = 'running'",
    "finish_model": "UPDATE messages SET content = ?, status = ?, tokens = ?, model = ? "
    "WHERE conversation_id = ? AND bucket = ? AND seq = ? IF status = 'running'",
    "get_message": f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? AND bucket = ? AND seq = ?",
    "messages_after": f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE conversation_id = ? AND bucket = ? AND seq > ?",
    "message_ids": "SELECT id FROM messages WHERE conversation_id = ? AND bucket = ?",
    "delete_bucket": "DELETE FROM messages WHERE conversation_id = ? AND bucket = ?",
    "delete_id": "DELETE FROM messages_by_id WHERE id = ?",
    "delete_conversation": "DELETE FROM conversations WHERE id = ?",
}
_GET_SCHEMA = "SELECT version, bucket_size FROM {ks}.schema_version WHERE component = 'conversations'"
_SET_SCHEMA = "INSERT INTO {ks}.schema_version (component, version, bucket_size, applied_at_ms) VALUES ('conversations', %s, %s, %s)"

T = TypeVar("T")
P = ParamSpec("P")


def _in_keyspace(query: str, keyspace: str) -> str:
    """The query with its table named as keyspace.table: Cassandra warns about prepared
    statements that rely on a session keyspace (USE)."""
    return re.sub(r"\b(FROM|INTO|UPDATE) (?=[a-z_]+\b)", rf"\1 {keyspace}.", query)


def parse_hosts(hosts: str) -> list[DefaultEndPoint]:
    """ "host[:port],..." (port 9042 when left out)."""
    endpoints = []
    for entry in filter(None, (part.strip() for part in hosts.split(","))):
        host, _, port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        endpoints.append(DefaultEndPoint(host, int(port) if port else 9042))
    if not endpoints:
        raise ValueError(f"no Cassandra host in {hosts!r}")
    return endpoints


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


def _message(row: dict[str, Any]) -> Message:
    fields = {key: row[key] for key in _MESSAGE_COLUMNS.split(", ")}
    return Message(**fields | {"role": Role(fields["role"]), "status": ReplyStatus(fields["status"])})


def _conversation(row: dict[str, Any]) -> Conversation:
    fields = {key: row[key] for key in _CONVERSATION_COLUMNS.split(", ")[:-2]}
    return Conversation(**fields, total_tokens=sum((row["token_counts"] or {}).values()))


class CassandraStore:
    def __init__(
        self,
        hosts: str,
        *,
        keyspace: str = "tandem",
        replication: str = "{'class': 'SimpleStrategy', 'replication_factor': 1}",
        consistency: str = "LOCAL_QUORUM",
        timeout_s: float = 5.0,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        username: str = "",
        password: str = "",
    ) -> None:
        """`username`: log in with it and `password` (the node's PasswordAuthenticator); empty: no login."""
        if not _KEYSPACE.match(keyspace):
            raise ValueError(f"{keyspace!r} is not a keyspace name (letters, digits, _)")
        self._hosts = hosts
        self._endpoints = parse_hosts(hosts)
        self._keyspace = keyspace
        self._replication = replication
        self._consistency = ConsistencyLevel.name_to_value[consistency]
        self._serial = ConsistencyLevel.LOCAL_SERIAL if consistency.startswith("LOCAL") else ConsistencyLevel.SERIAL
        self._timeout_s = timeout_s
        self._bucket_size = bucket_size
        self._auth = PlainTextAuthProvider(username, password) if username else None
        self._cluster: Cluster | None = None
        self._session: Session | None = None
        self._prepared: dict[str, PreparedStatement] = {}

    # --- connection, schema, requests

    async def start(self) -> None:
        if self._session is not None:
            return
        profile = ExecutionProfile(
            load_balancing_policy=TokenAwarePolicy(DCAwareRoundRobinPolicy()),
            consistency_level=self._consistency,
            serial_consistency_level=self._serial,
            request_timeout=self._timeout_s,
            row_factory=dict_factory,
        )
        cluster = Cluster(
            contact_points=self._endpoints,
            protocol_version=5,
            connection_class=_Connection,
            execution_profiles={EXEC_PROFILE_DEFAULT: profile},
            reconnection_policy=ExponentialReconnectionPolicy(0.5, 5.0),
            connect_timeout=self._timeout_s,
            control_connection_timeout=self._timeout_s,
            idle_heartbeat_interval=10,
            auth_provider=self._auth,
        )
        try:
            session = await asyncio.wait_for(asyncio.to_thread(cluster.connect), _DDL_TIMEOUT_S)
        except (*_DRIVER_ERRORS, TimeoutError) as exc:
            await asyncio.to_thread(cluster.shutdown)
            raise self._unavailable(exc) from None
        self._cluster, self._session = cluster, session
        try:
            await self._migrate()
            for name, query in _QUERIES.items():
                qualified = _in_keyspace(query, self._keyspace)
                self._prepared[name] = await asyncio.wait_for(asyncio.to_thread(session.prepare, qualified), _DDL_TIMEOUT_S)
        except (*_DRIVER_ERRORS, TimeoutError) as exc:
            await self.close()
            raise self._unavailable(exc) from None
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        cluster, self._cluster, self._session = self._cluster, None, None
        if cluster is not None:
            await asyncio.to_thread(cluster.shutdown)

    async def _migrate(self) -> None:
        ks = self._keyspace
        await self._ddl(f"CREATE KEYSPACE IF NOT EXISTS {ks} WITH replication = {self._replication}")
        await self._ddl(
            f"CREATE TABLE IF NOT EXISTS {ks}.schema_version (component text PRIMARY KEY, version int, bucket_size int, applied_at_ms bigint)"
        )
        # No `USE`: statements name their keyspace (Cassandra warns about USE with prepared statements).
        rows = (await self._execute(_GET_SCHEMA.format(ks=ks), ())).current_rows
        version, bucket_size = (rows[0]["version"], rows[0]["bucket_size"]) if rows else (0, self._bucket_size)
        if version > SCHEMA_VERSION:
            raise StoreUnavailable(f"cassandra keyspace {ks} has schema version {version}, newer than this code ({SCHEMA_VERSION})")
        if bucket_size != self._bucket_size:
            raise ValueError(f"keyspace {ks} buckets messages by {bucket_size}, not {self._bucket_size}: it cannot change")
        for step in range(version + 1, SCHEMA_VERSION + 1):
            for statement in _MIGRATIONS[step]:
                await self._ddl(statement.replace("CREATE TABLE IF NOT EXISTS ", f"CREATE TABLE IF NOT EXISTS {ks}.", 1))
            await self._execute(_SET_SCHEMA.format(ks=ks), (step, self._bucket_size, now_ms()))

    async def _ddl(self, statement: str) -> None:
        await self._execute(statement, (), timeout_s=_DDL_TIMEOUT_S)

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        if isinstance(exc, NoHostAvailable):
            why = "; ".join(f"{host}: {error}" for host, error in list(exc.errors.items())[:2]) or "no host is up"
            return StoreUnavailable(f"cassandra {self._hosts}: no host available ({why})")
        if isinstance(exc, TimeoutError):
            return StoreUnavailable(f"cassandra {self._hosts}: no answer within {self._timeout_s} s")
        detail = " ".join(str(exc).split()) or "no detail"
        return StoreUnavailable(f"cassandra {self._hosts}: {type(exc).__name__}: {detail[:300]}")

    async def _execute(
        self, statement: Any, params: Any, *, paging_state: bytes | None = None, timeout_s: float | None = None
    ) -> ResultSet:
        """One request; the driver's future is bridged to asyncio (its callbacks run on the driver's thread)."""
        if self._session is None:
            raise StoreUnavailable(f"cassandra {self._hosts}: the store is not started")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[ResponseFuture] = loop.create_future()

        def settle(outcome: Any, is_error: bool) -> None:
            if not done.done():
                done.set_exception(outcome) if is_error else done.set_result(outcome)

        try:
            future = self._session.execute_async(statement, params, timeout=timeout_s or self._timeout_s, paging_state=paging_state)
        except _DRIVER_ERRORS as exc:
            raise self._unavailable(exc) from None
        future.add_callbacks(
            lambda _: loop.call_soon_threadsafe(settle, future, False), lambda exc: loop.call_soon_threadsafe(settle, exc, True)
        )
        try:
            await done
        except _DRIVER_ERRORS as exc:
            raise self._unavailable(exc) from None
        return future.result()  # already complete: no wait

    async def _run(self, name: str, *params: Any) -> ResultSet:
        return await self._execute(self._prepared[name], params)

    async def _pages(self, name: str, params: tuple, page_size: int) -> AsyncIterator[dict[str, Any]]:
        """The rows of a query, fetched page by page as they are consumed."""
        bound = self._prepared[name].bind(params)
        bound.fetch_size = page_size
        paging_state = None
        while True:
            result = await self._execute(bound, None, paging_state=paging_state)
            for row in result.current_rows:
                yield row
            paging_state = result.paging_state
            if paging_state is None:
                return

    def _bucket(self, seq: int) -> int:
        return (seq - 1) // self._bucket_size

    # --- conversations

    async def _conversation_row(self, conversation_id: str) -> dict[str, Any] | None:
        rows = (await self._run("get_conversation", conversation_id)).current_rows
        return rows[0] if rows else None

    @_bounded
    async def create_conversation(self, conversation: Conversation) -> Conversation:
        c = conversation
        result = await self._run(
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
        stored = _conversation(row)
        # Idempotent: a retry after a crash between the two writes still lists the conversation.
        await self._run("index_insert", stored.user_id, stored.updated_at_ms, stored.id)
        return stored

    @_bounded
    async def get_conversation(self, user_id: str, conversation_id: str) -> Conversation | None:
        row = await self._conversation_row(conversation_id)
        return _conversation(row) if row is not None and row["user_id"] == user_id else None

    @_bounded
    async def list_conversations(self, user_id: str, *, limit: int = 50, before_ms: int | None = None) -> list[Conversation]:
        found: list[Conversation] = []
        seen: set[str] = set()
        entries = self._pages("index_page", (user_id, before_ms if before_ms is not None else 2**62), page_size=limit + 10)
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
            current.append(_conversation(row))
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
            await self._run("set_title", title, conversation_id)
            row["title"] = title
        if summary is not None or summary_upto_seq is not None:
            row["summary"] = row["summary"] if summary is None else summary
            row["summary_upto_seq"] = row["summary_upto_seq"] if summary_upto_seq is None else summary_upto_seq
            await self._run("set_summary", row["summary"], row["summary_upto_seq"], conversation_id)
        return _conversation(row)

    @_bounded
    async def delete_conversation(self, user_id: str, conversation_id: str) -> bool:
        row = await self._conversation_row(conversation_id)
        if row is None or row["user_id"] != user_id:
            return False
        # Messages first, the conversation last: a delete cut short leaves the conversation to
        # delete again, never messages that nothing points at.
        bucket = 0
        while ids := [r["id"] async for r in self._pages("message_ids", (conversation_id, bucket), page_size=500)]:
            await asyncio.gather(*(self._run("delete_id", message_id) for message_id in ids))
            await self._run("delete_bucket", conversation_id, bucket)
            bucket += 1  # seqs are contiguous: the first empty bucket is the last
        await self._run("index_delete", user_id, row["updated_at_ms"], conversation_id)
        await self._run("delete_conversation", conversation_id)
        return True

    # --- messages

    @_bounded
    async def append_message(self, user_id: str, message: NewMessage, *, title: str | None = None) -> Message:
        conversation = await self._conversation_row(message.conversation_id)
        if conversation is None or conversation["user_id"] != user_id:
            raise KeyError(message.conversation_id)
        claim = await self._run("claim_id", message.id, message.conversation_id)
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
        batch.add(self._prepared["set_id_seq"], (seq, message.id))
        batch.add(self._prepared["bump_conversation"], (seq, seq, row["tokens"], updated_at_ms, message.conversation_id))
        batch.add(self._prepared["index_delete"], (user_id, conversation["updated_at_ms"], message.conversation_id))
        batch.add(self._prepared["index_insert"], (user_id, updated_at_ms, message.conversation_id))
        if title is not None:
            batch.add(self._prepared["set_title"], (title, message.conversation_id))
        await self._execute(batch, None)
        return _message(row)

    async def _take_seq(self, message: NewMessage, seq: int) -> tuple[int, dict[str, Any]]:
        """The first free seq from `seq` on, taken with a Paxos insert; or the seq an earlier try
        of this same message already took (it is met on the way: seqs are taken in order)."""
        m = message
        created_at_ms = m.created_at_ms or now_ms()
        for _ in range(_MAX_SEQ_ATTEMPTS):
            values = (m.id, m.conversation_id, seq, m.parent_seq, m.role.value, m.content, m.tokens, m.model, m.status.value, created_at_ms)
            result = await self._run("claim_seq", *values, self._bucket(seq))
            if result.was_applied:
                return seq, dict(zip(_MESSAGE_COLUMNS.split(", "), values))
            if result.current_rows[0]["id"] == m.id:
                return seq, result.current_rows[0]
            seq += 1
        raise StoreUnavailable(f"cassandra {self._hosts}: no free seq in conversation {m.conversation_id} after {_MAX_SEQ_ATTEMPTS} tries")

    async def _message_at(self, conversation_id: str, seq: int) -> Message | None:
        rows = (await self._run("get_message", conversation_id, self._bucket(seq), seq)).current_rows
        return _message(rows[0]) if rows else None

    @_bounded
    async def finish_message(
        self, conversation_id: str, message_id: str, *, content: str, status: ReplyStatus, tokens: int, model: str = ""
    ) -> Message | None:
        if status not in FINAL_STATUSES:
            raise ValueError(f"{status.value} is not a final status")
        rows = (await self._run("get_id", message_id)).current_rows
        if not rows or rows[0]["conversation_id"] != conversation_id or rows[0]["seq"] is None:
            return None
        seq = rows[0]["seq"]
        if model:
            await self._run("finish_model", content, status.value, tokens, model, conversation_id, self._bucket(seq), seq)
        else:
            await self._run("finish", content, status.value, tokens, conversation_id, self._bucket(seq), seq)
        # Applied or not (the first final write wins), the stored row is the answer; counting its
        # tokens again is idempotent and repairs a count that a crash right here left behind.
        stored = await self._message_at(conversation_id, seq)
        if stored is None:
            return None
        await self._run("count_tokens", seq, stored.tokens, conversation_id)
        return stored

    @_bounded
    async def get_message(self, message_id: str) -> Message | None:
        rows = (await self._run("get_id", message_id)).current_rows
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
            async for row in self._pages("messages_after", (conversation_id, bucket, after_seq), page_size):
                found.append(_message(row))
                if limit is not None and len(found) >= limit:
                    break
            if len(found) == num_before:
                break  # an empty bucket: seqs are contiguous, so no later bucket has any
            bucket += 1
        return found
