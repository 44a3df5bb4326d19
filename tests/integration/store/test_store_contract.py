"""One contract, two stores: every case runs on a SQLite file and on a real Cassandra node."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import migrate_cassandra

from tandem.bus.events import ReplyStatus
from tandem.config import load_settings
from tandem.errors import StartupError
from tandem.store import (
    BRANCH_ROOT,
    Conversation,
    ConversationStore,
    Feedback,
    NewMessage,
    Rating,
    Role,
    cassandra_schema,
    open_store,
    sqlite,
)
from tandem.store import cassandra as cassandra_store

StoreFactory = Callable[[], Awaitable[ConversationStore]]


def new_conversation(user_id: str = "alice", updated_at_ms: int = 1_000, title: str = "a chat") -> Conversation:
    return Conversation(
        id=f"conv-{uuid.uuid4().hex}", user_id=user_id, title=title, model="auto", created_at_ms=updated_at_ms, updated_at_ms=updated_at_ms
    )


def user_turn(conversation: Conversation, content: str = "hello", tokens: int = 3, message_id: str | None = None) -> NewMessage:
    return NewMessage(
        id=message_id or f"msg-{uuid.uuid4().hex}", conversation_id=conversation.id, role=Role.USER, content=content, tokens=tokens
    )


def running_reply(conversation: Conversation, parent_seq: int) -> NewMessage:
    return NewMessage(
        id=f"msg-{uuid.uuid4().hex}",
        conversation_id=conversation.id,
        role=Role.ASSISTANT,
        content="",
        tokens=0,
        model="smollm2",
        status=ReplyStatus.RUNNING,
        parent_seq=parent_seq,
    )


async def test_a_created_conversation_reads_back_and_a_second_create_keeps_the_first(store: ConversationStore) -> None:
    conversation = new_conversation(title="first title")
    assert await store.create_conversation(conversation) == conversation
    again = await store.create_conversation(Conversation(**{**conversation.__dict__, "title": "second title"}))
    assert again == conversation
    assert await store.get_conversation("alice", conversation.id) == conversation
    assert conversation.id in [c.id for c in await store.list_conversations("alice")]


async def test_another_users_conversation_is_invisible_and_refuses_their_appends(store: ConversationStore) -> None:
    conversation = await store.create_conversation(new_conversation(user_id="alice"))
    assert await store.get_conversation("mallory", conversation.id) is None
    assert conversation.id not in [c.id for c in await store.list_conversations("mallory")]
    assert await store.update_conversation("mallory", conversation.id, title="mine now") is None
    with pytest.raises(KeyError):
        await store.append_message("mallory", user_turn(conversation))
    with pytest.raises(KeyError):
        await store.append_message("alice", user_turn(new_conversation()))  # never created
    assert await store.list_messages(conversation.id) == []
    assert (await store.get_conversation("alice", conversation.id)).title == conversation.title


async def test_turns_get_seqs_in_order_and_bump_the_conversation(store: ConversationStore) -> None:
    conversation = await store.create_conversation(new_conversation(updated_at_ms=1_000))
    question = await store.append_message("alice", user_turn(conversation, "what is 2+2?", tokens=7))
    reply = await store.append_message("alice", running_reply(conversation, parent_seq=question.seq))
    assert (question.seq, question.role, question.content, question.status) == (1, Role.USER, "what is 2+2?", ReplyStatus.COMPLETE)
    assert (reply.seq, reply.parent_seq, reply.role, reply.status, reply.model) == (2, 1, Role.ASSISTANT, ReplyStatus.RUNNING, "smollm2")
    assert question.created_at_ms > 0
    assert await store.list_messages(conversation.id) == [question, reply]
    assert await store.get_message(reply.id) == reply
    stored = await store.get_conversation("alice", conversation.id)
    assert stored.total_tokens == 7
    assert stored.updated_at_ms > conversation.updated_at_ms


@pytest.mark.parametrize("status", [ReplyStatus.COMPLETE, ReplyStatus.STOPPED, ReplyStatus.FAILED])
async def test_finishing_a_running_reply_stores_its_text_status_and_tokens(store: ConversationStore, status: ReplyStatus) -> None:
    conversation = await store.create_conversation(new_conversation())
    question = await store.append_message("alice", user_turn(conversation, tokens=4))
    reply = await store.append_message("alice", running_reply(conversation, parent_seq=question.seq))
    finished = await store.finish_message(conversation.id, reply.id, content="Four.", status=status, tokens=2)
    assert (finished.id, finished.seq, finished.content, finished.status, finished.tokens) == (reply.id, 2, "Four.", status, 2)
    assert await store.get_message(reply.id) == finished
    assert (await store.get_conversation("alice", conversation.id)).total_tokens == 6


async def test_the_first_final_write_wins(store: ConversationStore) -> None:
    conversation = await store.create_conversation(new_conversation())
    reply = await store.append_message("alice", running_reply(conversation, parent_seq=0))
    first = await store.finish_message(conversation.id, reply.id, content="partial", status=ReplyStatus.STOPPED, tokens=5)
    second = await store.finish_message(conversation.id, reply.id, content="the whole answer", status=ReplyStatus.COMPLETE, tokens=9)
    assert second == first
    assert (second.content, second.status, second.tokens) == ("partial", ReplyStatus.STOPPED, 5)
    assert (await store.get_conversation("alice", conversation.id)).total_tokens == 5


async def test_finishing_with_a_model_stores_the_model_that_wrote_it_and_without_keeps_the_appended_one(
    store: ConversationStore,
) -> None:
    conversation = await store.create_conversation(new_conversation())
    moved = await store.append_message("alice", running_reply(conversation, parent_seq=0))  # appended as "smollm2"
    kept = await store.append_message("alice", running_reply(conversation, parent_seq=0))
    finished = await store.finish_message(conversation.id, moved.id, content="Hi.", status=ReplyStatus.COMPLETE, tokens=2, model="large")
    assert (finished.model, (await store.get_message(moved.id)).model) == ("large", "large")
    unnamed = await store.finish_message(conversation.id, kept.id, content="Hi.", status=ReplyStatus.COMPLETE, tokens=2)
    assert (unnamed.model, (await store.get_message(kept.id)).model) == ("smollm2", "smollm2")
    late = await store.finish_message(conversation.id, moved.id, content="again", status=ReplyStatus.STOPPED, tokens=9, model="other")
    assert (late.model, late.content) == ("large", "Hi.")  # the first final write wins, model included


async def test_finishing_an_unknown_message_or_in_another_conversation_finds_nothing(store: ConversationStore) -> None:
    conversation = await store.create_conversation(new_conversation())
    other = await store.create_conversation(new_conversation())
    reply = await store.append_message("alice", running_reply(conversation, parent_seq=0))
    assert await store.finish_message(conversation.id, "msg-never-written", content="x", status=ReplyStatus.COMPLETE, tokens=1) is None
    assert await store.finish_message(other.id, reply.id, content="x", status=ReplyStatus.COMPLETE, tokens=1) is None
    assert (await store.get_message(reply.id)).status == ReplyStatus.RUNNING
    assert await store.get_message("msg-never-written") is None


async def test_conversations_list_newest_first_and_page_by_updated_at(store: ConversationStore) -> None:
    user = f"user-{uuid.uuid4().hex}"
    created = [await store.create_conversation(new_conversation(user_id=user, updated_at_ms=1_000 + i)) for i in range(5)]
    listed = await store.list_conversations(user)
    assert [c.id for c in listed] == [c.id for c in reversed(created)]
    # A new turn in the oldest conversation moves it to the top.
    await store.append_message(user, user_turn(created[0]))
    listed = await store.list_conversations(user)
    assert [c.id for c in listed] == [created[0].id] + [c.id for c in reversed(created[1:])]
    paged: list[str] = []
    before_ms = None
    while page := await store.list_conversations(user, limit=2, before_ms=before_ms):
        assert len(page) <= 2
        paged += [c.id for c in page]
        before_ms = page[-1].updated_at_ms
    assert paged == [c.id for c in listed]
    assert await store.list_conversations(user, before_ms=created[2].updated_at_ms) == [c for c in listed if c.id in {created[1].id}]


async def test_messages_page_by_seq_across_buckets(store: ConversationStore, bucket_size: int) -> None:
    assert bucket_size == 3  # the pages below assume it
    conversation = await store.create_conversation(new_conversation())
    num_messages = 3 * bucket_size + 1  # several Cassandra buckets, the last one partly filled
    appended = [await store.append_message("alice", user_turn(conversation, f"turn {i}")) for i in range(num_messages)]
    assert [m.seq for m in appended] == list(range(1, num_messages + 1))
    assert await store.list_messages(conversation.id) == appended
    pages, after_seq = [], 0
    while page := await store.list_messages(conversation.id, after_seq=after_seq, limit=4):
        pages.append([m.seq for m in page])
        after_seq = page[-1].seq
    assert pages == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert await store.list_messages(conversation.id, after_seq=bucket_size, limit=1) == [appended[bucket_size]]
    assert await store.list_messages(conversation.id, after_seq=num_messages) == []


async def test_two_writers_appending_at_once_get_distinct_contiguous_seqs(new_store: StoreFactory) -> None:
    writer_a, writer_b = await new_store(), await new_store()
    user = f"user-{uuid.uuid4().hex}"
    conversation = await writer_a.create_conversation(new_conversation(user_id=user))
    turns = [user_turn(conversation, f"turn {i}", tokens=i) for i in range(16)]
    appended = await asyncio.gather(*(writer.append_message(user, turn) for writer, turn in zip([writer_a, writer_b] * 8, turns)))
    assert sorted(m.seq for m in appended) == list(range(1, 17))
    stored = await writer_b.list_messages(conversation.id)
    assert [m.seq for m in stored] == list(range(1, 17))
    assert {m.id: m.seq for m in stored} == {m.id: m.seq for m in appended}
    stored_conversation = await writer_a.get_conversation(user, conversation.id)
    assert stored_conversation.total_tokens == sum(range(16))
    # Racing moves in the user's list leave it listed once, at its latest time.
    assert await writer_b.list_conversations(user) == [stored_conversation]


async def test_a_retried_append_with_the_same_id_stores_one_message(new_store: StoreFactory) -> None:
    writer_a, writer_b = await new_store(), await new_store()
    conversation = await writer_a.create_conversation(new_conversation())
    first = await writer_a.append_message("alice", user_turn(conversation, "once", tokens=5, message_id="msg-retried-1"))
    retried = await writer_b.append_message("alice", user_turn(conversation, "once", tokens=5, message_id="msg-retried-1"))
    assert retried == first
    # Two retries racing each other, from two clients.
    racing = user_turn(conversation, "racing", tokens=2)
    results = await asyncio.gather(writer_a.append_message("alice", racing), writer_b.append_message("alice", racing))
    assert results[0] == results[1]
    assert [(m.id, m.seq) for m in await writer_a.list_messages(conversation.id)] == [(first.id, 1), (racing.id, 2)]
    assert (await writer_a.get_conversation("alice", conversation.id)).total_tokens == 7
    # The same id in another conversation is refused, never answered with this conversation's message.
    other = await writer_a.create_conversation(new_conversation())
    with pytest.raises(ValueError, match="another conversation"):
        await writer_b.append_message("alice", user_turn(other, "once", message_id="msg-retried-1"))
    assert await writer_a.list_messages(other.id) == []


async def test_nothing_acknowledged_is_lost_when_the_client_restarts(new_store: StoreFactory) -> None:
    before = await new_store()
    conversation = await before.create_conversation(new_conversation())
    question = await before.append_message("alice", user_turn(conversation, "remember me", tokens=3))
    reply = await before.append_message("alice", running_reply(conversation, parent_seq=question.seq))
    await before.update_conversation("alice", conversation.id, title="renamed", summary="a summary", summary_upto_seq=1)
    await before.close()
    after = await new_store()
    assert await after.list_messages(conversation.id) == [question, reply]
    stored = await after.get_conversation("alice", conversation.id)
    assert (stored.title, stored.summary, stored.summary_upto_seq, stored.total_tokens) == ("renamed", "a summary", 1, 3)
    finished = await after.finish_message(conversation.id, reply.id, content="done", status=ReplyStatus.COMPLETE, tokens=1)
    assert (finished.seq, finished.content) == (2, "done")
    assert (await after.append_message("alice", user_turn(conversation))).seq == 3


async def test_an_update_changes_only_the_fields_given(store: ConversationStore) -> None:
    conversation = await store.create_conversation(new_conversation(title="before"))
    summarized = await store.update_conversation("alice", conversation.id, summary="they said hi", summary_upto_seq=2)
    assert (summarized.title, summarized.summary, summarized.summary_upto_seq) == ("before", "they said hi", 2)
    renamed = await store.update_conversation("alice", conversation.id, title="after")
    assert (renamed.title, renamed.summary, renamed.summary_upto_seq) == ("after", "they said hi", 2)
    assert await store.get_conversation("alice", conversation.id) == renamed


async def test_an_append_with_a_title_names_the_conversation_and_its_retry_or_a_plain_append_leaves_the_title(
    store: ConversationStore,
) -> None:
    conversation = await store.create_conversation(new_conversation(title=""))
    turn = user_turn(conversation, "how do tides work?")
    first = await store.append_message("alice", turn, title="how do tides work?")
    assert (await store.get_conversation("alice", conversation.id)).title == "how do tides work?"
    assert await store.append_message("alice", turn, title="a retry's title") == first  # the same id: nothing written
    await store.append_message("alice", running_reply(conversation, parent_seq=first.seq))
    stored = await store.get_conversation("alice", conversation.id)
    assert stored.title == "how do tides work?" and [m.seq for m in await store.list_messages(conversation.id)] == [1, 2]


async def test_open_store_builds_the_store_the_settings_name(store_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if store_kind == "cassandra":
        hosts, keyspace = request.getfixturevalue("cassandra_hosts"), f"settings_{uuid.uuid4().hex[:8]}"
        login = await migrate_cassandra(hosts, keyspace, ca_file=request.getfixturevalue("cassandra_ca_file"))
        settings = load_settings(
            store="cassandra",
            cassandra_hosts=hosts,
            cassandra_keyspace=keyspace,
            cassandra_username=login["username"],
            cassandra_password=login["password"],
            cassandra_ca_file=login["ca_file"],
            store_timeout_s=10,
        )
    else:
        settings = load_settings(store="sqlite", sqlite_path=tmp_path / "new" / "folder" / "conversations.db")
    store = open_store(settings)
    assert type(store).__name__ == {"sqlite": "SqliteStore", "cassandra": "CassandraStore"}[store_kind]
    await store.start()
    try:
        conversation = await store.create_conversation(new_conversation())
        assert await store.get_conversation("alice", conversation.id) == conversation
    finally:
        await store.close()
    if store_kind == "sqlite":
        assert settings.sqlite_path.is_file()


async def test_a_deleted_conversation_is_gone_with_every_message_and_only_its_owner_can_delete_it(
    store: ConversationStore, bucket_size: int
) -> None:
    conversation = await store.create_conversation(new_conversation())
    turns = [await store.append_message("alice", user_turn(conversation, f"turn {i}")) for i in range(2 * bucket_size)]
    reply = await store.append_message("alice", running_reply(conversation, parent_seq=turns[-1].seq))  # spans buckets
    kept = await store.create_conversation(new_conversation())
    kept_turn = await store.append_message("alice", user_turn(kept))

    assert await store.delete_conversation("mallory", conversation.id) is False
    assert len(await store.list_messages(conversation.id)) == len(turns) + 1, "another user's delete removed something"
    assert await store.delete_conversation("alice", conversation.id) is True

    assert await store.get_conversation("alice", conversation.id) is None
    assert [c.id for c in await store.list_conversations("alice")].count(conversation.id) == 0
    assert await store.list_messages(conversation.id) == []
    assert [await store.get_message(m.id) for m in [*turns, reply]] == [None] * (len(turns) + 1)
    late = await store.finish_message(conversation.id, reply.id, content="too late", status=ReplyStatus.COMPLETE, tokens=2)
    assert late is None, "a reply finished after its conversation was deleted brought it back"
    with pytest.raises(KeyError):
        await store.append_message("alice", user_turn(conversation))
    assert await store.get_conversation("alice", conversation.id) is None
    assert await store.delete_conversation("alice", conversation.id) is False
    assert await store.list_messages(kept.id) == [kept_turn]
    assert await store.get_conversation("alice", kept.id) is not None


async def test_each_message_keeps_the_parent_it_follows_the_branch_root_included(store: ConversationStore) -> None:
    """Branches (regenerated answers, edited messages) live in parent_seq alone: no column of their own."""
    conversation = await store.create_conversation(new_conversation())
    question = await store.append_message("alice", replace(user_turn(conversation), parent_seq=BRANCH_ROOT))
    answer = await store.append_message("alice", running_reply(conversation, parent_seq=question.seq))
    edited = await store.append_message("alice", replace(user_turn(conversation, "hello again"), parent_seq=BRANCH_ROOT))
    follow_up = await store.append_message("alice", replace(user_turn(conversation, "and then?"), parent_seq=answer.seq))
    stored = await store.list_messages(conversation.id)
    assert [(m.seq, m.parent_seq) for m in stored] == [(1, BRANCH_ROOT), (2, 1), (3, BRANCH_ROOT), (4, 2)]
    assert (edited.parent_seq, follow_up.parent_seq) == (BRANCH_ROOT, answer.seq)
    assert (await store.get_message(edited.id)).parent_seq == BRANCH_ROOT


# --- feedback


async def test_a_rating_reads_back_with_its_conversation_and_a_second_replaces_the_first(store: ConversationStore) -> None:
    conversation = await store.create_conversation(new_conversation())
    question = await store.append_message("alice", user_turn(conversation))
    answer = await store.append_message("alice", running_reply(conversation, parent_seq=question.seq))
    other = await store.append_message("alice", running_reply(conversation, parent_seq=question.seq))
    assert await store.list_feedback(conversation.id) == []

    first = Feedback(answer.id, conversation.id, Rating.UP, reason="", comment="", rated_at_ms=1_000)
    assert await store.rate_message(first) is None
    second = Feedback(answer.id, conversation.id, Rating.DOWN, reason="inaccurate", comment="2+2 is not 5", rated_at_ms=2_000)
    assert await store.rate_message(second) == first, "a second rating did not return the one it replaced"
    assert await store.rate_message(Feedback(other.id, conversation.id, Rating.UP)) is None
    stored = {f.message_id: f for f in await store.list_feedback(conversation.id)}
    assert stored[answer.id] == second
    assert (stored[other.id].rating, stored[other.id].reason) == (Rating.UP, "")
    assert stored[other.id].rated_at_ms > 0, "a rating without a time did not get the store's clock"
    assert len(stored) == 2


async def test_a_rating_of_a_message_not_in_the_conversation_is_refused_and_stores_nothing(store: ConversationStore) -> None:
    conversation = await store.create_conversation(new_conversation())
    elsewhere = await store.create_conversation(new_conversation())
    answer = await store.append_message("alice", running_reply(elsewhere, parent_seq=0))
    with pytest.raises(KeyError):
        await store.rate_message(Feedback(answer.id, conversation.id, Rating.UP))
    with pytest.raises(KeyError):
        await store.rate_message(Feedback(f"msg-{uuid.uuid4().hex}", conversation.id, Rating.UP))
    assert await store.list_feedback(conversation.id) == []
    assert await store.list_feedback(elsewhere.id) == []


async def test_deleting_a_conversation_deletes_its_ratings(store: ConversationStore) -> None:
    conversation = await store.create_conversation(new_conversation())
    answer = await store.append_message("alice", running_reply(conversation, parent_seq=0))
    await store.rate_message(Feedback(answer.id, conversation.id, Rating.DOWN, comment="wrong"))
    assert await store.delete_conversation("alice", conversation.id) is True
    assert await store.list_feedback(conversation.id) == []


# The tables schema 1 code knows nothing of: ratings (2), the usage ledger (3 on Cassandra) and shadow answers.
LATER_TABLES = ("message_feedback", "usage_replies", "usage_by_user", "usage_by_day", "shadow_answers")


async def test_a_store_written_by_schema_1_code_gains_ratings_when_newer_code_starts_on_it(
    store_kind: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upgrade: the first client runs with schema 1 alone (its tables, its queries), the next
    migrates the store it left and rates the answer it wrote. On Cassandra the services' role may
    not migrate: a newer client stops, naming `tandem store migrate`, until the admin has run it."""

    def client() -> ConversationStore:
        if store_kind == "sqlite":
            return sqlite.SqliteStore(tmp_path / "upgraded.db")
        return cassandra_store.CassandraStore(hosts, keyspace=keyspace, timeout_s=10, **login)

    keyspace, login = f"upgrade_{uuid.uuid4().hex[:8]}", {}
    hosts = request.getfixturevalue("cassandra_hosts") if store_kind == "cassandra" else ""
    ca_file = request.getfixturevalue("cassandra_ca_file") if store_kind == "cassandra" else ""
    with monkeypatch.context() as schema_1:
        if store_kind == "sqlite":
            schema_1.setattr(sqlite, "SCHEMA_VERSION", 1)
            schema_1.setattr(sqlite, "_SCHEMA", [s for s in sqlite._SCHEMA if not any(t in s for t in LATER_TABLES)])
        else:
            schema_1.setattr(cassandra_schema, "SCHEMA_VERSION", 1)
            queries = {name: query for name, query in cassandra_schema.QUERIES.items() if not any(t in query for t in LATER_TABLES)}
            schema_1.setattr(cassandra_store, "QUERIES", queries)
            login = await migrate_cassandra(hosts, keyspace, ca_file=ca_file)
        old = client()
        await old.start()
        conversation = await old.create_conversation(new_conversation())
        answer = await old.append_message("alice", running_reply(conversation, parent_seq=0))
        await old.close()
    new = client()
    if store_kind == "cassandra":
        with pytest.raises(StartupError, match=r"schema version 1, this code needs \d+: run `tandem store migrate`"):
            await new.start()
        await migrate_cassandra(hosts, keyspace, ca_file=ca_file)
    await new.start()
    try:
        assert await new.rate_message(Feedback(answer.id, conversation.id, Rating.UP, reason="clear")) is None
        assert [(f.message_id, f.rating, f.reason) for f in await new.list_feedback(conversation.id)] == [(answer.id, Rating.UP, "clear")]
    finally:
        await new.close()
