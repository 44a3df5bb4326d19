"""The CQL `tandem store migrate` writes for the application role, and what it refuses before it
connects (the real node's answers are in tests/integration/store/test_cassandra_app_role.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.errors import StartupError
from tandem.store.cassandra_admin import migrate_store
from tandem.store.cassandra_roles import alter_statement, check_name, cql_literal, revoke_statement


def test_a_quote_in_a_password_cannot_end_the_cql_string() -> None:
    assert cql_literal("it's'); DROP KEYSPACE tandem; --") == "'it''s''); DROP KEYSPACE tandem; --'"


def test_the_password_is_set_again_only_when_the_role_does_not_log_in_with_it() -> None:
    assert alter_statement("tandem_app", "pw", is_password_set=True) == "ALTER ROLE tandem_app WITH LOGIN = true AND SUPERUSER = false"
    assert "PASSWORD = 'pw'" in alter_statement("tandem_app", "pw", is_password_set=False)


def test_extra_data_permissions_are_revoked_by_their_cql_names_and_others_are_named_for_a_person() -> None:
    assert revoke_statement("app", "<all keyspaces>", "SELECT") == "REVOKE SELECT ON ALL KEYSPACES FROM app"
    assert revoke_statement("app", "<keyspace other>", "ALTER") == "REVOKE ALTER ON KEYSPACE other FROM app"
    assert revoke_statement("app", "<table ks.messages>", "DROP") == "REVOKE DROP ON TABLE ks.messages FROM app"
    with pytest.raises(StartupError, match="holds EXECUTE on <all functions>.*revoke it by hand"):
        revoke_statement("app", "<all functions>", "EXECUTE")


@pytest.mark.parametrize("name", ["tandem; DROP KEYSPACE x", "1tandem", "tandem-app", "a" * 49, ""])
def test_a_name_that_cql_would_not_take_unquoted_is_refused(name: str) -> None:
    with pytest.raises(StartupError, match="is not a Cassandra role name"):
        check_name(name, "role")


async def test_migrate_refuses_to_make_a_role_without_a_password_before_connecting() -> None:
    with pytest.raises(StartupError, match="TANDEM_CASSANDRA_APP_PASSWORD"):
        await migrate_store(
            "127.0.0.1:1", admin_username="a", admin_password="b", keyspace="tandem", app_role="tandem_app", app_password=""
        )


def test_migrate_on_the_sqlite_store_has_nothing_to_do() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "store", "migrate"],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"TANDEM_STORE": "sqlite"},
    )
    assert (done.returncode, done.stdout.startswith("nothing to migrate: TANDEM_STORE=sqlite")) == (0, True), done.stderr
