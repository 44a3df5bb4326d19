"""The admin's step on a Cassandra cluster (`tandem store migrate`, `tandem up` with
TANDEM_STORE=cassandra, the tests): the keyspace and tables (cassandra_schema.migrate), then the
application role brought to exactly its grants (cassandra_roles)."""

from __future__ import annotations

from tandem.errors import StartupError
from tandem.store.cassandra_roles import APP_PERMISSIONS, alter_statement, check_name, create_statement, revoke_statement
from tandem.store.cassandra_schema import DEFAULT_BUCKET_SIZE, migrate
from tandem.store.cassandra_session import DDL_TIMEOUT_S, CassandraSession, LoginRefused


async def migrate_store(
    hosts: str,
    *,
    admin_username: str,
    admin_password: str,
    keyspace: str,
    app_role: str,
    app_password: str,
    replication: str = "{'class': 'SimpleStrategy', 'replication_factor': 1}",
    consistency: str = "LOCAL_QUORUM",
    timeout_s: float = 10.0,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    ca_file: str = "",
) -> None:
    """The keyspace at SCHEMA_VERSION and `app_role` allowed APP_PERMISSIONS on it, as the admin.
    Raises StartupError for a bad name or a missing password, StoreUnavailable when the cluster
    does not answer or refuses the admin. `ca_file`: TLS (CassandraSession)."""
    check_name(keyspace, "keyspace")
    check_name(app_role, "role")
    if not app_password:
        raise StartupError(
            f"no password for the Cassandra role {app_role}: set TANDEM_CASSANDRA_APP_PASSWORD (tandem secrets DIR writes one)"
        )
    session = CassandraSession(
        hosts, consistency=consistency, timeout_s=timeout_s, username=admin_username, password=admin_password, ca_file=ca_file
    )
    await session.connect()
    try:
        await migrate(session, keyspace, replication, bucket_size)
        await ensure_app_role(session, hosts, app_role.lower(), app_password, keyspace.lower(), ca_file)
    finally:
        await session.close()


async def can_log_in(hosts: str, role: str, password: str, timeout_s: float, ca_file: str = "") -> bool:
    """Whether `role` logs in with `password` now (False also when the role does not exist)."""
    session = CassandraSession(hosts, consistency="ONE", timeout_s=timeout_s, username=role, password=password, ca_file=ca_file)
    try:
        await session.connect()
    except LoginRefused:
        return False
    await session.close()
    return True


async def ensure_app_role(session: CassandraSession, hosts: str, role: str, password: str, keyspace: str, ca_file: str = "") -> None:
    """Run as the admin on `hosts`: the role exists, logs in with `password`, and may do
    APP_PERMISSIONS on `keyspace` and nothing else. `role` and `keyspace` are checked names, in lowercase."""
    await session.execute(create_statement(role, password), (), timeout_s=DDL_TIMEOUT_S)
    is_password_set = await can_log_in(hosts, role, password, DDL_TIMEOUT_S, ca_file)
    await session.execute(alter_statement(role, password, is_password_set), (), timeout_s=DDL_TIMEOUT_S)
    rows = await _rows(session, f"LIST ALL PERMISSIONS OF {role} NORECURSIVE")
    held = {(row["resource"], row["permission"]) for row in rows}
    wanted = {(f"<keyspace {keyspace}>", permission) for permission in APP_PERMISSIONS}
    statements = [f"GRANT {permission} ON KEYSPACE {keyspace} TO {role}" for _, permission in sorted(wanted - held)]
    statements += [revoke_statement(role, resource, permission) for resource, permission in sorted(held - wanted)]
    for statement in statements:
        await session.execute(statement, (), timeout_s=DDL_TIMEOUT_S)
    for granted in {row["role"] for row in await _rows(session, f"LIST ROLES OF {role} NORECURSIVE")} - {role}:
        quoted = '"' + granted.replace('"', '""') + '"'
        await session.execute(f"REVOKE {quoted} FROM {role}", (), timeout_s=DDL_TIMEOUT_S)  # a granted role's permissions would be its


async def _rows(session: CassandraSession, statement: str) -> list[dict]:
    return list((await session.execute(statement, (), timeout_s=DDL_TIMEOUT_S)).current_rows)
