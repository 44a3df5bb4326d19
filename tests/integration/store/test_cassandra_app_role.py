"""The services' Cassandra role on the session's real node (issue 50): it reads and writes its own
keyspace's rows and is refused everything else a stolen login would try (dropping the keyspace,
altering a table, reading system_auth or another deployment's keyspace, making roles); `tandem
store migrate` runs twice to the same role, and takes back what was granted beyond it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from cassandra import Unauthorized
from helpers import cassandra_admin, cassandra_app_role, migrate_cassandra

from tandem.errors import StartupError
from tandem.store import Conversation, NewMessage, Role
from tandem.store.cassandra import CassandraStore
from tandem.store.cassandra_session import CassandraSession

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def app_keyspace() -> str:
    return f"role_{uuid.uuid4().hex[:12]}"


@pytest_asyncio.fixture(scope="module")
async def app_login(cassandra_hosts: str, cassandra_ca_file: str, app_keyspace: str) -> dict[str, str]:
    return await migrate_cassandra(cassandra_hosts, app_keyspace, ca_file=cassandra_ca_file)


async def connected(hosts: str, username: str, password: str, ca_file: str) -> CassandraSession:
    session = CassandraSession(
        hosts, consistency="LOCAL_QUORUM", timeout_s=TIMEOUT_S, username=username, password=password, ca_file=ca_file
    )
    await session.connect()
    return session


@pytest_asyncio.fixture(scope="module")
async def as_app(cassandra_hosts: str, app_login: dict[str, str]) -> AsyncIterator[CassandraSession]:
    """A session logged in as the services' role, as chat and relay are."""
    session = await connected(cassandra_hosts, **app_login)
    yield session
    await session.close()


@pytest_asyncio.fixture(scope="module")
async def as_admin(cassandra_hosts: str, cassandra_ca_file: str) -> AsyncIterator[CassandraSession]:
    session = await connected(cassandra_hosts, *cassandra_admin(), cassandra_ca_file)
    yield session
    await session.close()


async def permissions_of(admin: CassandraSession, role: str) -> set[tuple[str, str]]:
    rows = (await admin.execute(f"LIST ALL PERMISSIONS OF {role} NORECURSIVE", ())).current_rows
    return {(row["resource"], row["permission"]) for row in rows}


async def test_the_app_role_cannot_drop_its_keyspace(as_app: CassandraSession, as_admin: CassandraSession, app_keyspace: str) -> None:
    with pytest.raises(Unauthorized):
        await as_app.execute(f"DROP KEYSPACE {app_keyspace}", ())
    tables = (await as_admin.execute("SELECT table_name FROM system_schema.tables WHERE keyspace_name = %s", (app_keyspace,))).current_rows
    assert "messages" in {row["table_name"] for row in tables}


async def test_the_app_role_cannot_alter_drop_or_create_a_table(as_app: CassandraSession, app_keyspace: str) -> None:
    for statement in (
        f"ALTER TABLE {app_keyspace}.messages ADD stolen text",
        f"DROP TABLE {app_keyspace}.messages",
        f"CREATE TABLE {app_keyspace}.stolen (id text PRIMARY KEY)",
    ):
        with pytest.raises(Unauthorized):
            await as_app.execute(statement, ())


async def test_the_app_role_cannot_read_system_auth_or_another_keyspace(
    cassandra_hosts: str, cassandra_ca_file: str, as_app: CassandraSession, app_keyspace: str
) -> None:
    other_keyspace = f"other_{uuid.uuid4().hex[:12]}"
    await migrate_cassandra(cassandra_hosts, other_keyspace, ca_file=cassandra_ca_file)  # another deployment, with its own role
    for statement in ("SELECT role, salted_hash FROM system_auth.roles", f"SELECT * FROM {other_keyspace}.conversations"):
        with pytest.raises(Unauthorized):
            await as_app.execute(statement, ())
    assert (await as_app.execute(f"SELECT * FROM {app_keyspace}.conversations LIMIT 1", ())).current_rows == []


async def test_the_app_role_cannot_manage_roles(as_app: CassandraSession, app_keyspace: str) -> None:
    for statement in (
        "CREATE ROLE stolen WITH PASSWORD = 'x' AND LOGIN = true",
        f"GRANT ALTER ON KEYSPACE {app_keyspace} TO {cassandra_app_role(app_keyspace)}",
        f"ALTER ROLE {cassandra_app_role(app_keyspace)} WITH SUPERUSER = true",
    ):
        with pytest.raises(Unauthorized):
            await as_app.execute(statement, ())


async def test_the_store_works_as_the_app_role(cassandra_hosts: str, app_keyspace: str, app_login: dict[str, str]) -> None:
    store = CassandraStore(cassandra_hosts, keyspace=app_keyspace, timeout_s=TIMEOUT_S, **app_login)
    await store.start()
    try:
        conversation = await store.create_conversation(
            Conversation(id=f"conv-{uuid.uuid4().hex}", user_id="alice", title="t", model="auto", created_at_ms=1, updated_at_ms=1)
        )
        turn = NewMessage(id=f"msg-{uuid.uuid4().hex}", conversation_id=conversation.id, role=Role.USER, content="hi", tokens=1)
        stored = await store.append_message("alice", turn)  # a lightweight transaction: SELECT and MODIFY
        assert await store.list_messages(conversation.id) == [stored]
        assert await store.delete_conversation("alice", conversation.id) is True
        assert await store.get_conversation("alice", conversation.id) is None
    finally:
        await store.close()


async def test_a_store_on_a_keyspace_never_migrated_stops_naming_the_migrate_step(cassandra_hosts: str, app_login: dict[str, str]) -> None:
    store = CassandraStore(cassandra_hosts, keyspace=f"missing_{uuid.uuid4().hex[:12]}", timeout_s=TIMEOUT_S, **app_login)
    with pytest.raises(StartupError, match=r"does not exist: run `tandem store migrate`"):
        await store.start()
    assert not store._session.is_connected  # closed again: nothing left open


async def test_migrate_twice_leaves_the_role_as_it_was_and_takes_back_extra_grants(
    cassandra_hosts: str, as_admin: CassandraSession, app_keyspace: str, app_login: dict[str, str]
) -> None:
    role, other_role = cassandra_app_role(app_keyspace), f"extra_{uuid.uuid4().hex[:12]}"
    granted = {(f"<keyspace {app_keyspace}>", "SELECT"), (f"<keyspace {app_keyspace}>", "MODIFY")}
    assert await permissions_of(as_admin, role) == granted
    assert await migrate_cassandra(cassandra_hosts, app_keyspace, ca_file=app_login["ca_file"]) == app_login
    assert await permissions_of(as_admin, role) == granted

    for statement in (
        f"CREATE ROLE {other_role}",
        f"GRANT {other_role} TO {role}",  # its permissions would be the role's
        f"GRANT ALTER ON KEYSPACE {app_keyspace} TO {role}",
        f"GRANT SELECT ON ALL KEYSPACES TO {role}",
        f"GRANT DROP ON TABLE {app_keyspace}.messages TO {role}",
    ):
        await as_admin.execute(statement, ())
    assert len(await permissions_of(as_admin, role)) == len(granted) + 3
    await migrate_cassandra(cassandra_hosts, app_keyspace, ca_file=app_login["ca_file"])
    assert await permissions_of(as_admin, role) == granted
    roles = (await as_admin.execute(f"LIST ROLES OF {role}", ())).current_rows
    assert [(row["role"], row["super"], row["login"]) for row in roles] == [(role, False, True)]
