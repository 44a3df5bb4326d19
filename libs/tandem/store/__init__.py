"""The conversation store: one interface (base.py), SQLite and Cassandra implementations."""

from tandem.store.base import (
    FINAL_STATUSES,
    Conversation,
    ConversationStore,
    Message,
    MessageStatus,
    NewMessage,
    Role,
    StoreUnavailable,
    store_is_available,
)

__all__ = [
    "FINAL_STATUSES",
    "Conversation",
    "ConversationStore",
    "Message",
    "MessageStatus",
    "NewMessage",
    "Role",
    "StoreUnavailable",
    "store_is_available",
]
