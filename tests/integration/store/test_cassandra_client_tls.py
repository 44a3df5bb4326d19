"""Cassandra's client link is TLS, verified: on the session's node (which takes TLS clients only)
a plaintext client and a client trusting another CA are both refused before they can log in, and
the store works over TLS as the application role."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tandem.devstack.certs import make_cert_set
from tandem.errors import StartupError
from tandem.store import Conversation, StoreUnavailable
from tandem.store.cassandra import CassandraStore
from tandem.store.cassandra_session import LoginRefused

TIMEOUT_S = 5.0


@pytest.fixture
def tls_node_login(cassandra_ca_file: str, cassandra_login: dict[str, str], bucket_size: int) -> dict[str, object]:
    """The session keyspace's store settings, with the application role's login and the node's CA."""
    if not cassandra_ca_file:
        pytest.skip("TANDEM_CASSANDRA_HOSTS names a cluster in clear (no TANDEM_CASSANDRA_CA_FILE): nothing to refuse")
    return {"timeout_s": TIMEOUT_S, "bucket_size": bucket_size, **cassandra_login}


def new_conversation() -> Conversation:
    return Conversation(id=f"conv-{uuid.uuid4().hex}", user_id="alice", title="t", model="auto", created_at_ms=1, updated_at_ms=1)


async def test_the_store_works_over_tls_as_the_app_role(cassandra_hosts: str, keyspace: str, tls_node_login: dict[str, object]) -> None:
    store = CassandraStore(cassandra_hosts, keyspace=keyspace, **tls_node_login)
    await store.start()
    try:
        conversation = await store.create_conversation(new_conversation())
        assert await store.get_conversation("alice", conversation.id) == conversation
    finally:
        await store.close()


async def test_a_plaintext_client_is_refused(cassandra_hosts: str, keyspace: str, tls_node_login: dict[str, object]) -> None:
    store = CassandraStore(cassandra_hosts, keyspace=keyspace, **(tls_node_login | {"ca_file": ""}))
    with pytest.raises(StoreUnavailable) as refused:
        await store.start()
    assert not isinstance(refused.value, LoginRefused), "the node let a plaintext client reach its login"


async def test_a_client_trusting_another_ca_is_refused(
    cassandra_hosts: str, keyspace: str, tls_node_login: dict[str, object], tmp_path: Path
) -> None:
    other_ca = make_cert_set(tmp_path, services=("cassandra",)).ca_file  # the same names, another CA
    store = CassandraStore(cassandra_hosts, keyspace=keyspace, **(tls_node_login | {"ca_file": str(other_ca)}))
    with pytest.raises(StoreUnavailable) as refused:
        await store.start()
    assert not isinstance(refused.value, LoginRefused), "the client sent its password to a node it could not verify"


def test_a_missing_ca_file_stops_the_store_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="TANDEM_CASSANDRA_CA_FILE: no file at "):
        CassandraStore("127.0.0.1:9042", ca_file=str(tmp_path / "missing.pem"))
