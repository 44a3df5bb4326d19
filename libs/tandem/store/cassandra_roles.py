"""The Cassandra application role: the login chat and relay use, limited to reading and writing
rows of the application keyspace, so that a stolen service credential cannot drop or alter a
table, read another keyspace (system_auth's password hashes among them) or manage roles (issue 50).
This module holds its name, its grants and the CQL that makes it, without the driver (`tandem up`
and `tandem secrets` name the role); tandem.store.cassandra_admin runs the CQL.

Only `tandem store migrate` (tandem.ops.store_migrate) logs in as the admin: it creates the keyspace
and tables, then this role and its grants. Each run brings the role back to exactly what
APP_PERMISSIONS says: it sets the password where the role does not log in with it yet (a
rotation is a run with a new one), makes sure the role logs in and is no superuser, grants
SELECT and MODIFY on the keyspace, and revokes any other permission the role holds on data (a
keyspace, a table, all keyspaces) and any role granted to it. A permission on anything else
(functions, MBeans, roles) it cannot be sure how to name, so it stops and names it instead.

MODIFY covers INSERT, UPDATE, DELETE and TRUNCATE of the keyspace's tables; lightweight
transactions need SELECT too. Neither lets the role create, alter or drop anything.
"""

from __future__ import annotations

import re

from tandem.errors import StartupError

APP_ROLE = "tandem_app"
STORE_ROLES = ("chat", "relay")  # the services that log in as it
APP_PERMISSIONS = ("SELECT", "MODIFY")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,47}$")  # unquoted in CQL, which lowercases it
# How LIST PERMISSIONS shows a data resource, and how GRANT/REVOKE names it.
_DATA_RESOURCES = (
    (re.compile(r"^<all keyspaces>$"), "ALL KEYSPACES"),
    (re.compile(r"^<keyspace ([A-Za-z0-9_]+)>$"), "KEYSPACE {0}"),
    (re.compile(r"^<table ([A-Za-z0-9_]+\.[A-Za-z0-9_]+)>$"), "TABLE {0}"),
)


def cql_literal(text: str) -> str:
    """`text` as a CQL string constant (a quote is doubled)."""
    return "'" + text.replace("'", "''") + "'"


def check_name(name: str, kind: str) -> None:
    """A keyspace or role name tandem writes into CQL unquoted."""
    if not _NAME.match(name):
        raise StartupError(f"{name!r} is not a Cassandra {kind} name tandem accepts (a letter, then letters, digits, _)")


def create_statement(role: str, password: str) -> str:
    return f"CREATE ROLE IF NOT EXISTS {role} WITH PASSWORD = {cql_literal(password)} AND LOGIN = true"


def alter_statement(role: str, password: str, is_password_set: bool) -> str:
    """The role brought back to a login that is no superuser, with `password` unless
    `is_password_set` (Cassandra 5.0 refuses a role's second password change within 5 s)."""
    password_option = "" if is_password_set else f"PASSWORD = {cql_literal(password)} AND "
    return f"ALTER ROLE {role} WITH {password_option}LOGIN = true AND SUPERUSER = false"


def revoke_statement(role: str, resource: str, permission: str) -> str:
    """REVOKE `permission` on a resource as LIST PERMISSIONS shows it ("<table ks.t>")."""
    for pattern, cql in _DATA_RESOURCES:
        if found := pattern.match(resource):
            return f"REVOKE {permission} ON {cql.format(*found.groups())} FROM {role}"
    raise StartupError(
        f"Cassandra role {role} holds {permission} on {resource}, beyond its keyspace's {' and '.join(APP_PERMISSIONS)}: revoke it by hand"
    )
