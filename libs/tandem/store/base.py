"""The conversation store's contract: conversations by user (newest first), messages by
conversation in order, the usage ledger (usage.py): every reply's tokens, per user, model
and UTC day, and shadow answers (shadow.py): a candidate model version's answers to mirrored
requests, by the reply each mirrors. SQLite is the embedded default, Cassandra the production store; one
contract test suite runs against both.

Every write is acknowledged only once it is durable. Writes are idempotent by id, so a retry
after a timeout never makes a second conversation or message.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from enum import Enum
from typing import Protocol

from tandem.bus.events import ReplyStatus
from tandem.store.shadow import ShadowAnswer
from tandem.store.usage import ReplyUsage, UsageRow


class StoreUnavailable(Exception):
    """The store cannot be reached or did not answer in time; the API answers 503 with this message."""


# A message's parent_seq when it starts the conversation afresh: a first message edited (a
# sibling of message 1). 0 means not recorded (rows from before branches): the message before it.
# A named value, not a new column, so the stores' schemas stay as they are.
BRANCH_ROOT = -1


class Role(str, Enum):
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True)
class Conversation:
    id: str
    user_id: str
    title: str
    model: str
    created_at_ms: int
    updated_at_ms: int
    summary: str = ""
    summary_upto_seq: int = 0  # the summary covers messages with seq <= this
    total_tokens: int = 0  # sum of the messages' tokens


@dataclass(frozen=True)
class NewMessage:
    """A message to append; the store gives it the next seq of its conversation."""

    id: str  # idempotency key: appending the same id twice stores it once
    conversation_id: str
    role: Role
    content: str
    tokens: int  # its token count, counted once when saved so prompts never re-tokenize history
    model: str = ""
    status: ReplyStatus = ReplyStatus.COMPLETE
    # The message it follows: an answer's user turn, a user turn's answer (BRANCH_ROOT: none);
    # 0: not recorded, the message before it.
    parent_seq: int = 0
    created_at_ms: int = 0  # 0: the store's clock


@dataclass(frozen=True)
class Message:
    id: str
    conversation_id: str
    seq: int  # 1, 2, 3 ... in the order appended
    parent_seq: int
    role: Role
    content: str
    tokens: int
    model: str
    status: ReplyStatus
    created_at_ms: int


# --- feedback: an answer rated by its conversation's user


class Rating(str, Enum):
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True)
class Feedback:
    """A user's rating of one answer; rating it again replaces it."""

    message_id: str
    conversation_id: str
    rating: Rating
    reason: str = ""
    comment: str = ""
    rated_at_ms: int = 0  # 0: the store's clock


class ConversationStore(Protocol):
    async def start(self) -> None:
        """Connects and creates (or migrates) the schema; idempotent."""

    async def close(self) -> None: ...

    async def create_conversation(self, conversation: Conversation) -> Conversation:
        """Stores a new conversation; the same id again returns the stored one unchanged."""

    async def get_conversation(self, user_id: str, conversation_id: str) -> Conversation | None:
        """None when it does not exist or belongs to another user."""

    async def list_conversations(self, user_id: str, *, limit: int = 50, before_ms: int | None = None) -> list[Conversation]:
        """The user's conversations, most recently updated first; `before_ms` pages on updated_at_ms."""

    async def update_conversation(
        self,
        user_id: str,
        conversation_id: str,
        *,
        title: str | None = None,
        summary: str | None = None,
        summary_upto_seq: int | None = None,
    ) -> Conversation | None: ...

    async def delete_conversation(self, user_id: str, conversation_id: str) -> bool:
        """Deletes the conversation and all its messages; True when it was the user's and is now
        gone, False when it does not exist or belongs to another user. Afterwards its messages
        are not found by id, a late finish_message finds nothing and an append raises KeyError.
        Stop its running reply first: a reply appended while the delete runs may outlive it."""

    async def append_message(self, user_id: str, message: NewMessage, *, title: str | None = None) -> Message:
        """Appends with the next seq, bumps the conversation's updated_at_ms and total_tokens,
        and sets its title when `title` is given, in the same write. The same message id again
        returns the stored message and writes nothing. Raises KeyError when the conversation does
        not exist for this user."""

    async def finish_message(
        self, conversation_id: str, message_id: str, *, content: str, status: ReplyStatus, tokens: int, model: str = ""
    ) -> Message | None:
        """A running message becomes final with its text and token count, and `model` (the one
        that wrote it) when given; empty keeps the model it was appended with. A message already
        final is left as it is (the first final write wins) and returned. None when it does not exist."""

    async def get_message(self, message_id: str) -> Message | None: ...

    async def list_messages(self, conversation_id: str, *, after_seq: int = 0, limit: int | None = None) -> list[Message]:
        """In seq order, those with seq > after_seq, at most `limit`."""

    # --- feedback

    async def rate_message(self, feedback: Feedback) -> Feedback | None:
        """Stores the rating of a message of the conversation, replacing the one before; returns
        the one it replaced (None: the first). The caller checks that the message is the user's
        answer. Raises KeyError when the message is not in that conversation. Deleting the
        conversation deletes its ratings."""

    async def list_feedback(self, conversation_id: str) -> list[Feedback]:
        """The conversation's ratings, one per rated message, in no particular order."""

    async def record_usage(self, usage: ReplyUsage) -> None:
        """Adds one reply's usage to the ledger; the same reply id again changes nothing (the
        first write stands), so a retried or redelivered settlement is counted once."""

    async def usage_of(self, user_id: str, *, since: date) -> list[UsageRow]:
        """The user's usage per model and UTC day from `since` on, ordered by day and model."""

    async def usage_since(self, since: date) -> list[UsageRow]:
        """Every user's usage per model and UTC day from `since` on (the admin export), ordered by
        day, user and model."""

    # --- shadow answers

    async def record_shadow_answer(self, answer: ShadowAnswer) -> None:
        """Stores a shadow reply's answer; the same reply id again changes nothing. Deleting the
        conversation of the reply it mirrors deletes it (when it is stored by then)."""

    async def shadow_answers(self, shadow_of: str) -> list[ShadowAnswer]:
        """The shadow answers to the reply `shadow_of`, oldest first."""


async def store_is_available(store: ConversationStore) -> bool:
    """For readiness checks: one cheap read that must answer."""
    try:
        await store.get_conversation("_readiness", "_readiness")
    except Exception:  # StoreUnavailable, or a store whose start has not finished
        return False
    return True
