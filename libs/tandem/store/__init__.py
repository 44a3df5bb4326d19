"""The conversation store: one interface (base.py), SQLite and Cassandra implementations."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.store.base import (
    BRANCH_ROOT,
    Conversation,
    ConversationStore,
    Feedback,
    Message,
    NewMessage,
    Rating,
    Role,
    StoreUnavailable,
    store_is_available,
)
from tandem.store.shadow import ShadowAnswer
from tandem.store.usage import ReplyUsage, UsageRow

if TYPE_CHECKING:
    from tandem.config import Settings


def open_store(settings: Settings) -> ConversationStore:
    """The configured store, not yet started (`await store.start()` connects; SQLite creates its
    schema there, Cassandra's is made beforehand by `tandem store migrate`)."""
    if settings.store == "cassandra":
        from tandem.store.cassandra import CassandraStore

        return CassandraStore(
            settings.cassandra_hosts,
            keyspace=settings.cassandra_keyspace,
            consistency=settings.cassandra_consistency,
            timeout_s=settings.store_timeout_s,
            username=settings.cassandra_username,
            password=settings.cassandra_password.get_secret_value(),
            ca_file=settings.cassandra_ca_file,
        )
    from tandem.store.sqlite import SqliteStore

    return SqliteStore(settings.sqlite_path, timeout_s=settings.store_timeout_s)


__all__ = [
    "BRANCH_ROOT",
    "Conversation",
    "ConversationStore",
    "Feedback",
    "Message",
    "NewMessage",
    "Rating",
    "ReplyUsage",
    "Role",
    "ShadowAnswer",
    "StoreUnavailable",
    "UsageRow",
    "store_is_available",
]
