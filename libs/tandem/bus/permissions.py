"""Who may publish and subscribe to what on the bus: each service process logs in as its own
instance's user (`Identity`: tandem up, tests), allowed only the subjects its role uses and, where
a subject names an instance, only its own (`rights_of`). Plus an `operator` user for tools (tandem generate
--via-bus, benches, tests, `tandem bus init`) with every right: the only user that may create,
update or delete a stream (STREAM_ADMIN is denied to every service). `render_config` turns a
list of users into nats-server's `authorization` block, with literal passwords (tandem up) or
none: in containers (compose, Kubernetes) nats-server maps each client's certificate to its user
(`verify_and_map`), and each instance's certificate names that instance alone (`cert_user`), so
no container holds a bus password (deploy/nats/nats.conf, deploy/helm/nats-values.yaml).

Every service answers pings and requests through `allow_responses` (a reply may go only to the
inbox of a request it received) rather than a right to publish on every inbox. Token subjects
carry replies' text: workers publish them, and the router and the relay publish a reply's final
event when no worker can (nothing to place it on, a worker gone quiet); chat and anonymous
clients never can."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.bus import subjects
from tandem.bus.token_stream import STREAM
from tandem.tls import server_name

SERVICE_ROLES = ("prefill", "decode", "router", "relay", "chat")
OPERATOR = "operator"
USERS = (*SERVICE_ROLES, OPERATOR)

_P = subjects.PREFIX
_TOKEN_EVENTS = f"{_P}.tokens.*"  # one reply's events; a batch (tokens.batch.<worker>) has a token more
_FINALS = subjects.FINALS_ALL  # the router's and the relays' final events: never a token
_CANCELS = subjects.CANCEL_ALL
_HANDOFFS = subjects.HANDOFFS_ALL
_ASSIGNS = f"{_P}.worker.*.assign"
_KV_EVENTS = subjects.KV_EVENTS_ALL
_KV_STATES = f"{_P}.kv.state.*"
_PINGS = f"{_P}.ping.*"
_WORKER_HEARTBEATS = (subjects.heartbeats_of("prefill"), subjects.heartbeats_of("decode"))
# Looking the token stream up (a service waits for it), and the account probe a worker uses to
# tell a bus that is down from one that refuses.
_TOKEN_STREAM_LOOKUP = ("$JS.API.INFO", f"$JS.API.STREAM.INFO.{STREAM}")
# What only the operator may: make, change or empty a stream (`tandem bus init` does). Denied to
# every service role by name, so no allow added later (a wildcard) can give it back.
STREAM_ADMIN = (
    "$JS.API.STREAM.CREATE.*",
    "$JS.API.STREAM.UPDATE.*",
    "$JS.API.STREAM.DELETE.*",
    "$JS.API.STREAM.PURGE.*",
)
# The relay's durable pull consumer: look it up, create it, pull from it, acknowledge.
_TOKEN_CONSUMER = (
    f"$JS.API.CONSUMER.INFO.{STREAM}.*",
    f"$JS.API.CONSUMER.CREATE.{STREAM}.>",
    f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.*",
    f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.*",
    f"$JS.ACK.{STREAM}.>",
)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = True  # may answer requests it received (pings, assignments, ...)
    publish_deny: tuple[str, ...] = ()  # refused even where an allow matches


ANY_INSTANCE = "*"  # a role's user (containers): its rights hold for every instance of the role


def _checked_token(value: str, what: str) -> str:
    if not subjects.is_token(value):
        raise ValueError(f"{what} {value!r} may hold only letters, digits, '-' and '_'")
    return value


def inbox_prefix(role: str, instance_id: str) -> str:
    """Where a service's replies arrive (nats-py's `inbox_prefix`): request/reply answers, the
    JetStream API's and the relay's pulled token events. Under `_INBOX.<role>.<instance>`, so a
    user may read its own and no other's; the operator keeps nats-py's `_INBOX.<random>`."""
    return f"_INBOX.{_checked_token(role, 'role')}.{_checked_token(instance_id, 'instance id')}"


def rights_of(role: str, own: str = ANY_INSTANCE) -> Permissions:
    """What a service of `role` may do, bound to the instance `own`: its heartbeat, pings, inbox,
    assignments, KV state requests, KV events and token batches name it. With ANY_INSTANCE, every
    instance of the role (a role's user). Cancels and per-reply token events stay role-wide: a
    reply id names no instance."""
    if own != ANY_INSTANCE:
        _checked_token(own, "instance id")
    publish = [f"{_P}.heartbeat.{role}.{own}"]
    subscribe = [f"{_P}.ping.{own}", f"_INBOX.{role}.{own}.>"]
    if role in ("prefill", "decode"):
        publish += [_TOKEN_EVENTS, f"{_P}.tokens.batch.{own}", f"{_P}.kv.events.{own}", *_TOKEN_STREAM_LOOKUP]
        subscribe += [f"{_P}.worker.{own}.assign", _CANCELS, f"{_P}.kv.state.{own}"]
    if role == "prefill":
        publish.append(_HANDOFFS)
    if role == "router":
        publish += [_ASSIGNS, _KV_STATES, subjects.LADDER, subjects.ROLLOUT, _FINALS, *_TOKEN_STREAM_LOOKUP]
        subscribe += [*_WORKER_HEARTBEATS, _KV_EVENTS, _CANCELS, _HANDOFFS, subjects.GENERATE, subjects.OUTCOMES, subjects.ROLLOUT]
    if role == "relay":
        publish += [subjects.GENERATE, _CANCELS, _PINGS, _FINALS, subjects.OUTCOMES, *_TOKEN_STREAM_LOOKUP, *_TOKEN_CONSUMER]
        subscribe += _WORKER_HEARTBEATS
    if role == "chat":
        publish += [subjects.GENERATE, _CANCELS]
        subscribe += [subjects.heartbeats_of("decode"), subjects.LADDER, subjects.ROLLOUT]
    return Permissions(publish=tuple(publish), subscribe=tuple(subscribe), publish_deny=STREAM_ADMIN)


PERMISSIONS: dict[str, Permissions] = {
    **{role: rights_of(role) for role in SERVICE_ROLES},
    OPERATOR: Permissions(publish=(">",), subscribe=(">",)),
}


@dataclass(frozen=True)
class Identity:
    """One service process's bus user (tandem up, tests): its instance id is its user name, its
    rights are its role's bound to that instance."""

    role: str
    instance_id: str

    @property
    def rights(self) -> Permissions:
        return rights_of(self.role, self.instance_id)


def password_variable(user: str) -> str:
    """The environment variable that holds `user`'s bus password in containers."""
    return f"TANDEM_NATS_PASSWORD_{user.upper()}"


def literal(password: str) -> str:
    """A password written into the config as it is (tandem up's own, generated per run)."""
    return json.dumps(password)


def render_config(users: Sequence[tuple[str, Permissions, str | None]], header: str = "") -> str:
    """nats-server's `authorization` block for `users`: (name, rights, the password's config
    text, `literal(...)`; None: the user's certificate maps to it)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines.append("authorization {")
    lines.append("  users = [")
    for user, rights, password in users:
        login = "" if password is None else f" password: {password},"
        lines.append(f"    {{user: {json.dumps(user)},{login} permissions: {{")
        deny = f", deny: {json.dumps(list(rights.publish_deny))}" if rights.publish_deny else ""
        lines.append(f"      publish: {{allow: {json.dumps(list(rights.publish))}{deny}}}")
        lines.append(f"      subscribe: {{allow: {json.dumps(list(rights.subscribe))}}}")
        if rights.allow_responses:
            lines.append("      allow_responses: true")
        lines.append("    }}")
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


OPERATOR_CERT_USER = server_name(OPERATOR)  # what the operator's certificate names (operator.tandem.internal)
# Compose runs one container per role, each a fixed instance (no `--scale`: a second container
# would log in with the same certificate as the same instance).
COMPOSE_INSTANCES = tuple(Identity(role, f"{role}-0") for role in SERVICE_ROLES)
# Kubernetes runs each role as a StatefulSet, whose pods are named <role>-0, <role>-1, ...: the
# user pool per role, as many as it may run (the workers' HorizontalPodAutoscaler maxReplicas;
# tests/unit/deploy/test_k8s_manifests.py checks the manifests stay within it).
K8S_POOL_SIZES = {"prefill": 16, "decode": 32, "router": 4, "relay": 4, "chat": 8}


def cert_user(identity: Identity) -> str:
    """The user an instance's certificate maps to: the DNS name only its certificate carries,
    decode-0.decode.tandem.internal (cert-manager's csi-driver writes the pod's name into it)."""
    return f"{_checked_token(identity.instance_id, 'instance id')}.{server_name(identity.role)}"


def pool(sizes: dict[str, int]) -> list[Identity]:
    return [Identity(role, f"{role}-{index}") for role, size in sizes.items() for index in range(size)]


def cert_mapped_users(identities: Sequence[Identity]) -> list[tuple[str, Permissions, str | None]]:
    """The operator and one user per instance, each logged in by its certificate alone."""
    users: list[tuple[str, Permissions, str | None]] = [(OPERATOR_CERT_USER, PERMISSIONS[OPERATOR], None)]
    return users + [(cert_user(identity), identity.rights, None) for identity in identities]


def mapped_tls_config(folder: str) -> str:
    """nats-server's `tls` block for cert-mapped users, with tandem.devstack.certs' file names
    under `folder`: every client shows a certificate of the CA, and its names pick its user; a
    certificate that names no user is refused, passwords are never looked at."""
    return (
        "tls {\n"
        f"  cert_file: {json.dumps(folder + '/nats.pem')}\n"
        f"  key_file: {json.dumps(folder + '/nats.key')}\n"
        f"  ca_file: {json.dumps(folder + '/ca.pem')}\n"
        "  verify_and_map: true\n"
        "  timeout: 2\n"
        "}\n"
    )


CONTAINER_HEADER = """Tandem's bus users for compose: the operator and one user per service container, each
allowed only its instance's subjects, each logged in by its certificate (`tandem secrets DIR`
issues one per instance; TLS below maps it to its user). Generated by libs/tandem/bus/permissions.py
(tests/unit/bus/test_nats_conf_fresh.py checks it is current; regenerate with
`python -m tandem.bus.permissions`); do not edit by hand. JetStream, ports and the store come from
the server's command line."""
CONTAINER_TLS_FOLDER = "/etc/tandem/tls"  # where compose mounts the certificates


def render_container_config() -> str:
    header = "".join(f"# {line}\n" if line else "#\n" for line in CONTAINER_HEADER.splitlines())
    return header + mapped_tls_config(CONTAINER_TLS_FOLDER) + render_config(cert_mapped_users(COMPOSE_INSTANCES))


HELM_BEGIN = "      # BEGIN users generated by tandem.bus.permissions (python -m tandem.bus.permissions)"
HELM_END = "      # END users"


def render_helm_users(identities: Sequence[Identity]) -> str:
    """deploy/helm/nats-values.yaml's `config.merge.authorization.users` entries, between the
    HELM_BEGIN and HELM_END lines."""
    lines = [HELM_BEGIN]
    for user, rights, _ in cert_mapped_users(identities):
        deny = f", deny: {json.dumps(list(rights.publish_deny))}" if rights.publish_deny else ""
        lines.append(f"        - user: {json.dumps(user)}")
        lines.append("          permissions:")
        lines.append(f"            publish: {{allow: {json.dumps(list(rights.publish))}{deny}}}")
        lines.append(f"            subscribe: {{allow: {json.dumps(list(rights.subscribe))}}}")
        lines.append(f"            allow_responses: {json.dumps(rights.allow_responses)}")
    lines.append(HELM_END)
    return "\n".join(lines) + "\n"


def with_helm_users(values: str) -> str:
    """`values` (nats-values.yaml's text) with the generated users replaced by today's."""
    head, _, rest = values.partition(HELM_BEGIN + "\n")
    _, _, tail = rest.partition(HELM_END + "\n")
    return head + render_helm_users(pool(K8S_POOL_SIZES)) + tail


def _main() -> None:
    """Rewrites the two generated files from this table (run from the repository's root)."""
    Path("deploy/nats/nats.conf").write_text(render_container_config())
    helm = Path("deploy/helm/nats-values.yaml")
    helm.write_text(with_helm_users(helm.read_text()))


if __name__ == "__main__":
    _main()
