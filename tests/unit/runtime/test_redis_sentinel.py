"""Reading settings.redis_sentinels, and the client a sentinel target gives (built, not connected)."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

from tandem.redis_sentinel import SentinelTarget, parse_sentinels, reader_like, sentinel_target
from tandem.runtime.runtime import REDIS_POOL_WAIT_S, short_command_client


def test_sentinels_are_read_as_host_port_pairs():
    assert parse_sentinels("10.0.0.1:26379, redis-s2:26380") == (("10.0.0.1", 26379), ("redis-s2", 26380))


@pytest.mark.parametrize("spec", ["10.0.0.1", "host:port", ":26379", "a:1,,b:2"])
def test_a_sentinel_without_host_and_port_is_refused_by_name(spec):
    with pytest.raises(ValueError, match="must be host:port"):
        parse_sentinels(spec)


def test_no_sentinels_means_no_target():
    assert sentinel_target("", "tandem", "pw") is None
    assert sentinel_target("h:1", "tandem", "pw") == SentinelTarget((("h", 1),), "tandem", "pw")


async def test_the_short_command_client_asks_the_sentinels_with_the_pools_limits_and_the_urls_database():
    target = SentinelTarget((("127.0.0.1", 1),), "tandem", "sentinel-pw")
    client = short_command_client("redis://ignored:1/3", 7, {"password": "pw"}, target)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "tandem"
    assert (pool.max_connections, pool.timeout) == (7, REDIS_POOL_WAIT_S)  # type: ignore[attr-defined]
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (3, "pw")
    sentinel = pool.sentinel_manager.sentinels[0]
    assert sentinel.connection_pool.connection_kwargs["password"] == "sentinel-pw"
    reader = reader_like(client, "redis://ignored:1/3", socket_timeout_s=15)
    reader_pool = reader.connection_pool
    assert isinstance(reader_pool, SentinelConnectionPool) and reader_pool.sentinel_manager is pool.sentinel_manager
    assert (reader_pool.connection_kwargs["db"], reader_pool.connection_kwargs["password"]) == (3, "pw")
    assert reader_pool.connection_kwargs["socket_timeout"] == 15
    await reader.aclose()
    await client.aclose()


async def test_a_rediss_url_makes_the_sentinels_the_primary_and_the_readers_connections_tls_with_its_ca():
    target = SentinelTarget((("127.0.0.1", 1),), "tandem", "sentinel-pw")
    url = "rediss://ignored:1/3?ssl_ca_certs=/etc/tandem/tls/ca.crt"
    client = short_command_client(url, 7, {"password": "pw"}, target)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    reader = reader_like(client, url, socket_timeout_s=15)
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool
    for connections in (pool, reader.connection_pool, sentinel):
        assert issubclass(connections.connection_class, SSLConnection), connections
        assert connections.connection_kwargs["ssl_ca_certs"] == "/etc/tandem/tls/ca.crt"
    assert issubclass(pool.connection_class, SentinelManagedSSLConnection)
    plain = short_command_client("redis://ignored:1/3", 7, {}, target)
    assert not issubclass(plain.connection_pool.connection_class, SSLConnection)
    assert not issubclass(plain.connection_pool.sentinel_manager.sentinels[0].connection_pool.connection_class, SSLConnection)
    for each in (reader, client, plain):
        await each.aclose()
