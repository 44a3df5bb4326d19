"""Credentials for the internal surfaces: a bus password per user of tandem.bus.permissions, the
Redis password, the shared secret of gRPC control calls and KV handoffs, and (containers) the
Cassandra passwords: the admin's, which only `tandem store migrate` logs in with, and the
application role's, which chat and relay log in with.

`tandem up` and the test servers make a set per work folder with `load_or_create`: every
password is derived from one random key, which is the `operator` user's own password. The
operator may already publish and subscribe to everything, so whoever holds its password gains
nothing from deriving the others; it lets a test that knows only the server's operator URL give
each service process its own instance's login (tests/helpers.py does). `tandem secrets DIR` makes an
independent random value for each secret, for containers: DIR/tandem.env (an env file), one
file per secret under DIR/secrets/, each named like its variable, and the TLS certificates under
DIR/tls/ (tandem.devstack.certs)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from tandem.bus.connection import server_urls, without_credentials
from tandem.bus.permissions import COMPOSE_INSTANCES, OPERATOR, PERMISSIONS, USERS, Identity, literal, password_variable, render_config
from tandem.devstack.certs import make_cert_set
from tandem.errors import StartupError
from tandem.redis_acl import ROLES as REDIS_ROLES
from tandem.store.cassandra_roles import APP_ROLE

REDIS_PASSWORD = "TANDEM_REDIS_PASSWORD"  # the admin's (Redis's default user); no service is given it
REDIS_USERNAME = "TANDEM_REDIS_USERNAME"
INTERNAL_SECRET = "TANDEM_INTERNAL_SECRET"
CASSANDRA_PASSWORD = "TANDEM_CASSANDRA_PASSWORD"  # the admin's (the superuser); no service is given it
CASSANDRA_APP_PASSWORD = "TANDEM_CASSANDRA_APP_PASSWORD"  # the application role's (tandem.store.cassandra_roles)
CASSANDRA_LOGIN = ("TANDEM_CASSANDRA_USERNAME", CASSANDRA_PASSWORD, CASSANDRA_APP_PASSWORD)
LOCAL_FILE = "secrets.env"
_NUM_RANDOM_BYTES = 24


@dataclass(frozen=True)
class StackSecrets:
    operator_password: str = field(
        repr=False
    )  # the bus operator's; services log in as their instances (tandem up) or with certificates (containers)
    redis_password: str = field(repr=False)
    redis_passwords: dict[str, str] = field(repr=False)  # Redis ACL user (a role of tandem.redis_acl) -> password
    internal_secret: str = field(repr=False)
    redis_sentinel_password: str = field(default="", repr=False)  # tandem up --ha: the sentinels' own, which services hold
    cassandra_password: str = field(default="", repr=False)  # containers only: tandem up runs no Cassandra
    cassandra_app_password: str = field(default="", repr=False)  # the application role's (tandem up: when the store is Cassandra)

    @classmethod
    def generate(cls) -> StackSecrets:
        """Independent random values (containers)."""
        return cls(
            operator_password=_random(),
            redis_password=_random(),
            redis_passwords={role: _random() for role in REDIS_ROLES},
            internal_secret=_random(),
            cassandra_password=_random(),
            cassandra_app_password=_random(),
        )

    @classmethod
    def derived_from(cls, operator_password: str) -> StackSecrets:
        """The local set whose operator password is `operator_password` (see the module's docstring)."""
        return cls(
            operator_password=operator_password,
            redis_password=_derive(operator_password, "redis"),
            redis_passwords={role: _derive(operator_password, f"redis:{role}") for role in REDIS_ROLES},
            internal_secret=_derive(operator_password, "internal"),
            redis_sentinel_password=_derive(operator_password, "redis-sentinel"),
            cassandra_app_password=_derive(operator_password, "cassandra:app"),
        )

    def variables(self) -> dict[str, str]:
        """Every secret under its environment variable's name."""
        found = {password_variable(OPERATOR): self.operator_password}
        found[REDIS_PASSWORD] = self.redis_password
        found.update({redis_password_variable(role): password for role, password in self.redis_passwords.items()})
        found[INTERNAL_SECRET] = self.internal_secret
        if self.cassandra_password:
            found[CASSANDRA_PASSWORD] = self.cassandra_password
            found[CASSANDRA_APP_PASSWORD] = self.cassandra_app_password
        return found

    def instance_password(self, instance_id: str) -> str:
        """The bus password of a local service instance (tandem up, tests), whose user name is its
        instance id: derived from the operator's, as the module's docstring says."""
        return _derive(self.operator_password, f"nats-instance:{instance_id}")

    def service_env(self, role: str, instance_id: str) -> dict[str, str]:
        """What one local service process of `role` needs: its instance's bus login, its role's
        Redis login (a role without Redis: none), the internal secret."""
        redis_login = {REDIS_USERNAME: role, REDIS_PASSWORD: self.redis_passwords[role]} if role in self.redis_passwords else {}
        return {
            "TANDEM_INSTANCE_ID": instance_id,
            "TANDEM_NATS_USER": instance_id,
            "TANDEM_NATS_PASSWORD": self.instance_password(instance_id),
            **redis_login,
            INTERNAL_SECRET: self.internal_secret,
        }

    def cassandra_login(self) -> dict[str, str]:
        """The application role's login, as chat's and relay's settings."""
        return {"TANDEM_CASSANDRA_USERNAME": APP_ROLE, CASSANDRA_PASSWORD: self.cassandra_app_password}

    def nats_config(self, identities: Iterable[Identity]) -> str:
        """The local server's users: the operator and one per service instance of `identities`."""
        users = [(OPERATOR, PERMISSIONS[OPERATOR], literal(self.operator_password))]
        for identity in identities:
            if identity.instance_id in USERS:
                raise StartupError(f"instance id {identity.instance_id!r} is the name of a bus user of its own")
            users.append((identity.instance_id, identity.rights, literal(self.instance_password(identity.instance_id))))
        return render_config(users, "Tandem's bus users (tandem up); generated, do not edit.")


def redis_password_variable(role: str) -> str:
    """Where `tandem secrets` puts a Redis role's password: TANDEM_REDIS_CHAT_PASSWORD; a service reads it as TANDEM_REDIS_PASSWORD."""
    return f"TANDEM_REDIS_{role.upper()}_PASSWORD"


def _random() -> str:
    # A letter first: compose's nats.conf reads each bus password from the environment, and
    # nats-server parses a value that starts with '-' as a number and refuses to start
    # ("Expected a digit but got 'l'"): one password in 64, about one generated set in ten.
    return "t" + secrets.token_urlsafe(_NUM_RANDOM_BYTES)


def _derive(key: str, purpose: str) -> str:
    digest = hmac.new(key.encode(), purpose.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest[:_NUM_RANDOM_BYTES]).decode().rstrip("=")


def with_login(url: str, user: str, password: str) -> str:
    """`url` with a user and password in it (nats://user:pw@host:port, redis://:pw@host:port/0)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def login_of(url: str) -> tuple[str, str, str]:
    """(the URL without its login, its user, its password); "" for what it lacks. A cluster's
    comma-separated URLs carry one login: the first's."""
    parts = urlsplit(server_urls(url)[0])
    return without_credentials(url), unquote(parts.username or ""), unquote(parts.password or "")


def local_service_env(role: str, instance_id: str, nats_url: str) -> dict[str, str]:
    """The settings of instance `instance_id` of `role` on a local bus known by its operator URL
    (a test server's or a stack's `.url`): the URL without the login, the instance's own (the
    server must list it: tandem.devstack.bus_users), the Redis password and the internal secret
    of that set."""
    address, _, operator_password = login_of(nats_url)
    env = {"TANDEM_NATS_URL": address, "TANDEM_INSTANCE_ID": instance_id}
    if operator_password:
        env.update(StackSecrets.derived_from(operator_password).service_env(role, instance_id))
    return env


def write_private(path: Path, text: str) -> None:
    """Writes `text` readable by this user alone (created 0600, never world-readable meanwhile)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def env_file_text(variables: dict[str, str]) -> str:
    return "".join(f"{name}={value}\n" for name, value in variables.items())


def load_or_create(folder: Path) -> StackSecrets:
    """The local set of `folder` (a stack's or a test server's work folder): the one written
    there before, so a server restarted on the folder keeps its logins, else a new one."""
    path = folder / LOCAL_FILE
    if path.is_file():
        for line in path.read_text().splitlines():
            name, _, value = line.partition("=")
            if name == password_variable(OPERATOR):
                return StackSecrets.derived_from(value)
        raise StartupError(f"{path} holds no {password_variable(OPERATOR)}: remove it to make a new set")
    made = StackSecrets.derived_from(_random())
    write_private(path, env_file_text(made.variables()))
    return made


def write_container_set(folder: Path, made: StackSecrets, is_overwrite: bool) -> list[Path]:
    """`folder`/tandem.env and `folder`/secrets/<VARIABLE> for each secret; returns the files."""
    env_file = folder / "tandem.env"
    if env_file.exists() and not is_overwrite:
        raise StartupError(f"{env_file} exists: pass --force to replace every secret in {folder} (a rotation)")
    variables = made.variables()
    write_private(env_file, env_file_text(variables))
    written = [env_file]
    for name, value in variables.items():
        written.append(folder / "secrets" / name)
        write_private(written[-1], value)
    return written


def add_cli(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "secrets",
        help="write a new set of internal credentials for containers (compose, Kubernetes)",
        description="Writes DIR/tandem.env (KEY=value lines for compose's env_file) and DIR/secrets/<VARIABLE>, "
        "one file per secret (for compose, or for Kubernetes: `tandem secrets deploy/k8s/secrets/generated` makes one Secret per role, deploy/README.md): "
        "a bus password per user, the Redis passwords, the Cassandra admin's and application role's passwords and the internal shared secret; "
        "and DIR/tls/: a new CA (ca.pem) and a certificate and key per service for TLS on every internal link, "
        "plus one per compose service instance (decode-0.pem, ...): NATS maps each to that instance's bus user. "
        "Files are readable by you alone.",
    )
    parser.add_argument("dir", type=Path, help="the folder to write to (created if missing)")
    parser.add_argument("--force", action="store_true", help="replace an existing set (rotates every secret, and the CA)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    written = write_container_set(args.dir, StackSecrets.generate(), args.force)
    certs = make_cert_set(args.dir, instances=COMPOSE_INSTANCES)
    written += sorted(certs.folder.iterdir())
    for path in written:
        print(path)
    return 0
