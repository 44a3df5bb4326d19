"""The stores when something else goes wrong: a node that stops and comes back, a file locked by
another process, two processes writing one SQLite file."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import freeze, migrate_cassandra

from tandem.devstack.cassandra_node import RunningNode, stop_node
from tandem.devstack.proc import free_port
from tandem.store import Conversation, NewMessage, Role, StoreUnavailable
from tandem.store.cassandra import CassandraStore
from tandem.store.sqlite import SqliteStore

RECOVERY_DEADLINE_S = 90.0


def new_conversation() -> Conversation:
    return Conversation(id=f"conv-{uuid.uuid4().hex}", user_id="alice", title="t", model="auto", created_at_ms=1, updated_at_ms=1)


def turn(conversation: Conversation, content: str = "hi") -> NewMessage:
    return NewMessage(id=f"msg-{uuid.uuid4().hex}", conversation_id=conversation.id, role=Role.USER, content=content, tokens=1)


async def test_cassandra_store_is_unavailable_while_the_node_is_down_and_recovers_by_itself(
    own_cassandra_node: Callable[..., RunningNode],
) -> None:
    node = own_cassandra_node()
    timeout_s = 2.0
    store = CassandraStore(
        node.hosts, keyspace="recovery", timeout_s=timeout_s, **await migrate_cassandra(node.hosts, "recovery", ca_file=node.ca_file)
    )
    await store.start()
    try:
        conversation = await store.create_conversation(new_conversation())
        first = await store.append_message("alice", turn(conversation, "before the crash"))

        freeze(node.pid)  # a node that accepts but never answers: the timeout bounds the call
        try:
            started_s = time.monotonic()
            with pytest.raises(StoreUnavailable, match=f"^cassandra {node.hosts}: "):
                await store.get_conversation("alice", conversation.id)
            # Bounded by the timeout, not hung; the slack is for a loaded machine.
            assert timeout_s - 0.5 < time.monotonic() - started_s < 3 * timeout_s + 2
        finally:
            os.kill(node.pid, signal.SIGCONT)
        assert (await store.get_conversation("alice", conversation.id)).total_tokens == 1

        stop_node(node, kill=True)

        for call in (lambda: store.get_conversation("alice", conversation.id), lambda: store.append_message("alice", turn(conversation))):
            started_s = time.monotonic()
            with pytest.raises(StoreUnavailable) as failure:
                await call()
            assert time.monotonic() - started_s < 3 * timeout_s + 2
            message = str(failure.value)
            assert message.startswith(f"cassandra {node.hosts}: ") and "\n" not in message, message

        own_cassandra_node(native_port=node.native_port, storage_port=node.storage_port)  # same folder, same data
        deadline_s = time.monotonic() + RECOVERY_DEADLINE_S
        while True:  # the same client, never restarted: the driver reconnects on its own
            try:
                stored = await store.get_conversation("alice", conversation.id)
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline_s, f"no recovery within {RECOVERY_DEADLINE_S} s"
                await asyncio.sleep(0.25)
        assert stored is not None and stored.total_tokens == 1
        assert await store.list_messages(conversation.id) == [first]
        assert (await store.append_message("alice", turn(conversation, "after"))).seq == 2
    finally:
        await store.close()


async def test_cassandra_store_start_says_unavailable_when_nothing_listens() -> None:
    hosts = f"127.0.0.1:{free_port()}"
    store = CassandraStore(hosts, keyspace="nowhere", timeout_s=1.0)
    started_s = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"^cassandra {hosts}: no host available"):
        await store.start()
    assert time.monotonic() - started_s < 10


def python_child(script: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )


async def test_sqlite_store_is_unavailable_while_another_process_holds_the_write_lock(tmp_path: Path) -> None:
    path = tmp_path / "conversations.db"
    store = SqliteStore(path, timeout_s=0.5)
    await store.start()
    conversation = await store.create_conversation(new_conversation())
    holder = python_child(f"""
        import sqlite3, sys
        db = sqlite3.connect({str(path)!r}, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        print("locked", flush=True)
        sys.stdin.readline()
        db.execute("COMMIT")
    """)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreUnavailable, match="locked"):
            await store.append_message("alice", turn(conversation))
        holder.stdin.write("release\n")
        holder.stdin.flush()
        assert holder.wait(timeout=10) == 0
        assert (await store.append_message("alice", turn(conversation))).seq == 1
    finally:
        holder.kill()
        await store.close()


async def test_sqlite_appends_from_two_processes_get_distinct_contiguous_seqs(tmp_path: Path) -> None:
    path = tmp_path / "conversations.db"
    store = SqliteStore(path)
    await store.start()
    conversation = await store.create_conversation(new_conversation())
    num_each = 30
    other = python_child(f"""
        import asyncio, sys
        from tandem.store import NewMessage, Role
        from tandem.store.sqlite import SqliteStore
        async def main():
            store = SqliteStore(__import__("pathlib").Path({str(path)!r}))
            await store.start()
            print("ready", flush=True)
            sys.stdin.readline()
            for i in range({num_each}):
                await store.append_message("alice", NewMessage(f"other-{{i}}", {conversation.id!r}, Role.USER, "x", 1))
            await store.close()
        asyncio.run(main())
    """)
    try:
        assert other.stdout.readline().strip() == "ready"
        other.stdin.write("go\n")
        other.stdin.flush()
        for i in range(num_each):
            await store.append_message("alice", NewMessage(f"mine-{i}", conversation.id, Role.USER, "y", 1))
        assert await asyncio.to_thread(other.wait, 30) == 0
        stored = await store.list_messages(conversation.id)
        assert [m.seq for m in stored] == list(range(1, 2 * num_each + 1))
        assert {m.id for m in stored} == {f"{who}-{i}" for who in ("mine", "other") for i in range(num_each)}
        assert (await store.get_conversation("alice", conversation.id)).total_tokens == 2 * num_each
    finally:
        other.kill()
        await store.close()


async def test_cassandra_append_that_died_after_taking_its_seq_is_finished_by_its_retry(
    cassandra_hosts: str, keyspace: str, bucket_size: int, cassandra_login: dict[str, str]
) -> None:
    store = CassandraStore(cassandra_hosts, keyspace=keyspace, bucket_size=bucket_size, **cassandra_login)
    await store.start()
    try:
        conversation = await store.create_conversation(new_conversation())
        await store.append_message("alice", turn(conversation, "first"))
        interrupted = turn(conversation, "the writer died after taking seq 2")
        # The first two steps of append_message, as a writer that then crashed would have left them:
        # the id claimed, the seq row written, but neither the id's seq nor the conversation updated.
        await store._session.run("claim_id", interrupted.id, conversation.id)
        await store._take_seq(interrupted, 2)
        assert await store.get_message(interrupted.id) is None
        retried = await store.append_message("alice", interrupted)
        assert (retried.seq, retried.content) == (2, interrupted.content)
        assert [m.seq for m in await store.list_messages(conversation.id)] == [1, 2]
        assert await store.get_message(interrupted.id) == retried
        assert (await store.get_conversation("alice", conversation.id)).total_tokens == 2
        assert (await store.append_message("alice", turn(conversation))).seq == 3
    finally:
        await store.close()
