"""`tandem store migrate`: the admin step of the Cassandra store. It logs in as the admin
(TANDEM_CASSANDRA_USERNAME / TANDEM_CASSANDRA_PASSWORD, a superuser), creates the keyspace
(TANDEM_CASSANDRA_REPLICATION), brings its tables to the code's schema version, and makes the
application role chat and relay log in as, with TANDEM_CASSANDRA_APP_PASSWORD and only SELECT and
MODIFY on the keyspace (tandem.store.cassandra_roles). The services no longer change the schema:
they check it at start and stop with a line naming this command when it is missing or old.

Run it once before the services, and again after an upgrade or to rotate the role's password:
compose runs it as its one-shot `store-migrate` service, Kubernetes as the `store-migrate` Job,
the tests before their stores start. Running it twice changes nothing the second time. The
SQLite store makes its own schema at start: with TANDEM_STORE=sqlite there is nothing to do."""

from __future__ import annotations

import argparse
import asyncio
import sys

from tandem.errors import StartupError
from tandem.store.base import StoreUnavailable

# The driver is imported when the step runs, not with the `tandem` command every service starts from.


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
    bucket_size: int | None = None,
) -> None:
    """The keyspace at SCHEMA_VERSION and `app_role` allowed APP_PERMISSIONS on it, as the admin.
    `bucket_size`: None, the store's default. Raises StartupError for a bad name or a missing
    password, StoreUnavailable when the cluster does not answer or refuses the admin."""
    from tandem.store.cassandra_roles import check_name, ensure_app_role
    from tandem.store.cassandra_schema import DEFAULT_BUCKET_SIZE, migrate
    from tandem.store.cassandra_session import CassandraSession

    check_name(keyspace, "keyspace")
    check_name(app_role, "role")
    if not app_password:
        raise StartupError(
            f"no password for the Cassandra role {app_role}: set TANDEM_CASSANDRA_APP_PASSWORD (tandem secrets DIR writes one)"
        )
    session = CassandraSession(hosts, consistency=consistency, timeout_s=timeout_s, username=admin_username, password=admin_password)
    await session.connect()
    try:
        await migrate(session, keyspace, replication, bucket_size or DEFAULT_BUCKET_SIZE)
        await ensure_app_role(session, hosts, app_role.lower(), app_password, keyspace.lower())
    finally:
        await session.close()


def _run(args: argparse.Namespace) -> int:
    from tandem.config import load_settings
    from tandem.store.cassandra_roles import APP_PERMISSIONS, APP_ROLE
    from tandem.store.cassandra_schema import SCHEMA_VERSION

    settings = load_settings()
    app_role = args.app_role or APP_ROLE
    if settings.store != "cassandra":
        print(f"nothing to migrate: TANDEM_STORE={settings.store} makes its own schema when a service starts")
        return 0
    try:
        asyncio.run(
            migrate_store(
                settings.cassandra_hosts,
                admin_username=settings.cassandra_username,
                admin_password=settings.cassandra_password.get_secret_value(),
                keyspace=settings.cassandra_keyspace,
                app_role=app_role,
                app_password=settings.cassandra_app_password.get_secret_value(),
                replication=settings.cassandra_replication,
                consistency=settings.cassandra_consistency,
            )
        )
    except StoreUnavailable as exc:
        raise StartupError(f"tandem store migrate: {exc}") from None
    print(
        f"keyspace {settings.cassandra_keyspace} at schema version {SCHEMA_VERSION}; "
        f"role {app_role} may {' and '.join(APP_PERMISSIONS)} in it, nothing else"
    )
    return 0


def add_cli(commands: argparse._SubParsersAction) -> None:
    store = commands.add_parser("store", help="the conversation store's admin steps")
    actions = store.add_subparsers(dest="action", required=True)
    migrate_cli = actions.add_parser(
        "migrate",
        help="create or upgrade the Cassandra keyspace and the services' role (the admin's login)",
        description="Creates the keyspace TANDEM_CASSANDRA_KEYSPACE (TANDEM_CASSANDRA_REPLICATION) and its tables, or "
        "upgrades them, then the application role chat and relay log in as, with TANDEM_CASSANDRA_APP_PASSWORD and only "
        "SELECT and MODIFY on the keyspace. Logs in as TANDEM_CASSANDRA_USERNAME (a superuser) at "
        "TANDEM_CASSANDRA_HOSTS. Idempotent; run it again to rotate the role's password.",
    )
    migrate_cli.add_argument("--app-role", help="the services' role (default tandem_app)")
    migrate_cli.set_defaults(run=_run)


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.ops.store_migrate`: the same step where only the package is installed
    (the compose service and the Kubernetes Job run it so)."""
    parser = argparse.ArgumentParser(prog="tandem")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["store", "migrate", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.run(args))
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
