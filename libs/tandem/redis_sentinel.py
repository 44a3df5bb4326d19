"""Finding the Redis primary through Sentinel (settings.redis_sentinels): a client whose every
new connection asks the sentinels where the primary is now, so a failover costs the commands in
flight while it happens, not the process.

Those commands fail with a redis ConnectionError (MasterNotFoundError while no primary is named,
a refused connection to the dead one, and ReadOnlyError from a primary demoted to replica is
turned into one by redis-py's sentinel connection); callers treat them as they treat a Redis
restart. The database, user and password are the redis URL's and the login's, as without
sentinels.

TLS comes from the URL too: a `rediss://` one (its CA in `ssl_ca_certs`, as without sentinels)
makes every connection TLS, to the sentinels as to the primary they name, each checked against
that CA and the name or address it was dialed by; the sentinels of a TLS set listen on TLS
alone (tandem.devstack.redis_ha, the Helm values' `tls`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

SENTINEL_TIMEOUT_S = 0.5  # one sentinel's answer; discovery moves on to the next


@dataclass(frozen=True)
class SentinelTarget:
    addresses: tuple[tuple[str, int], ...]
    master: str  # the name the sentinels monitor it by
    password: str = field(default="", repr=False)  # the sentinels' own (tandem up: the Redis password)


def parse_sentinels(spec: str) -> tuple[tuple[str, int], ...]:
    """ "host:port,host:port" -> ((host, port), ...); ValueError naming a bad entry."""
    addresses = []
    for entry in (part.strip() for part in spec.split(",")):
        host, _, port = entry.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel {entry!r} must be host:port")
        addresses.append((host, int(port)))
    return tuple(addresses)


def sentinel_target(spec: str, master: str, password: str) -> SentinelTarget | None:
    """settings.redis_sentinels and the rest as a target; None when no sentinels are set."""
    return SentinelTarget(parse_sentinels(spec), master, password) if spec.strip() else None


class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The primary's connections, at most max_connections: a command waits `timeout` for a free
    one, as runtime's short-command client does without sentinels."""


def _tls_of(url: str) -> dict[str, Any]:
    """The TLS a `rediss://` URL asks for, as a connection's keyword arguments; none for another scheme."""
    if not url.lower().startswith("rediss://"):
        return {}
    parsed = parse_url(url)
    return {"ssl": True} | {name: value for name, value in parsed.items() if name in ("ssl_ca_certs", "ssl_check_hostname")}


def master_client(target: SentinelTarget, url: str, **pool_kwargs: Any) -> Redis:
    """A client of the primary the sentinels name; `url` gives the database, TLS (`rediss://`)
    and a login, which `pool_kwargs` override; `pool_kwargs` the pool's limits, timeouts and retry."""
    from_url: dict[str, Any] = {name: value for name, value in parse_url(url).items() if name in ("db", "username", "password")}
    tls = _tls_of(url)
    sentinel = Sentinel(
        target.addresses,
        sentinel_kwargs={"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
        | tls
        | ({"password": target.password} if target.password else {}),
        **tls,  # every master_for's, reader_like's too
    )
    return sentinel.master_for(target.master, connection_pool_class=BlockingSentinelPool, **(from_url | pool_kwargs))


def reader_like(client: Redis, url: str, socket_timeout_s: float) -> Redis:
    """A client of its own for a blocking read, to where `client` goes (the primary the same
    sentinels name, or `url`) with its login: a short-command client's connections must not be
    held by reads."""
    login = {k: v for k, v in client.get_connection_kwargs().items() if k in ("username", "password") and v}
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        return pool.sentinel_manager.master_for(
            pool.service_name, db=pool.connection_kwargs.get("db", 0), socket_timeout=socket_timeout_s, **login
        )
    return Redis.from_url(url, socket_timeout=socket_timeout_s, single_connection_client=True, **login)
