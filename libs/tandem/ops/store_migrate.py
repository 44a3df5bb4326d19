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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.errors import StartupError
from tandem.store.base import StoreUnavailable
from tandem.store.cassandra_roles import APP_PERMISSIONS, APP_ROLE

if TYPE_CHECKING:
    from tandem.config import Settings


@dataclass(frozen=True)
class StoreAdmin:
    """The admin's login and the keyspace's settings: what the step migrates with."""

    hosts: str
    username: str
    password: str = field(repr=False)
    keyspace: str
    replication: str
    consistency: str
    ca_file: str = ""  # TLS to the cluster, verified against this CA; empty: in clear

    @classmethod
    def from_settings(cls, settings: Settings) -> StoreAdmin | None:
        """None for a store that makes its own schema (SQLite)."""
        if settings.store != "cassandra":
            return None
        return cls(
            hosts=settings.cassandra_hosts,
            username=settings.cassandra_username,
            password=settings.cassandra_password.get_secret_value(),
            keyspace=settings.cassandra_keyspace,
            replication=settings.cassandra_replication,
            consistency=settings.cassandra_consistency,
            ca_file=settings.cassandra_ca_file,
        )

    async def migrate(self, app_role: str, app_password: str) -> None:
        """The step; raises StartupError naming what to fix (the driver is imported here, not
        with the `tandem` command every service starts from)."""
        from tandem.store.cassandra_admin import migrate_store

        try:
            await migrate_store(
                self.hosts,
                admin_username=self.username,
                admin_password=self.password,
                keyspace=self.keyspace,
                app_role=app_role,
                app_password=app_password,
                replication=self.replication,
                consistency=self.consistency,
                ca_file=self.ca_file,
            )
        except StoreUnavailable as exc:
            raise StartupError(f"tandem store migrate: {exc}") from None


def _run(args: argparse.Namespace) -> int:
    from tandem.config import load_settings

    settings = load_settings()
    admin = StoreAdmin.from_settings(settings)
    if admin is None:
        print(f"nothing to migrate: TANDEM_STORE={settings.store} makes its own schema when a service starts")
        return 0
    app_role = args.app_role or APP_ROLE
    asyncio.run(admin.migrate(app_role, settings.cassandra_app_password.get_secret_value()))
    from tandem.store.cassandra_schema import SCHEMA_VERSION  # loaded by the step

    print(
        f"keyspace {admin.keyspace} at schema version {SCHEMA_VERSION}; role {app_role} may {' and '.join(APP_PERMISSIONS)} in it, nothing else"
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
    migrate_cli.add_argument("--app-role", help=f"the services' role (default {APP_ROLE})")
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
