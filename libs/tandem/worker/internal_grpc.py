"""The shared secret on the workers' gRPC surfaces (WorkerControl, KvHandoff): every call carries
TANDEM_INTERNAL_SECRET in its metadata, and a server with a secret answers UNAUTHENTICATED to a call
without it, before any handler runs. `tandem up`, compose and Kubernetes always set one.

An empty secret turns the check off, which is safe only where nobody else can connect: a worker
on a loopback host (a bare `tandem serve`) may run without one; on any other host it refuses to
start (check_internal_secret) unless TANDEM_ALLOW_INSECURE_INTERNAL says so, since anyone who
reaches its gRPC port could drain it or reserve its KV blocks.

With TANDEM_TLS_* set (tandem.tls: `tandem up`, compose, Kubernetes) the port is mutual TLS as
well, and the secret travels only inside it."""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import Counter

from tandem.errors import StartupError
from tandem.tls import INTERNAL_DOMAIN, TlsSettings, server_name

SECRET_METADATA_KEY = "x-tandem-internal-secret"
CALLS_REFUSED = Counter("tandem_grpc_calls_unauthenticated_total", "gRPC calls refused for a missing or wrong internal secret")
log = logging.getLogger(__name__)


class SharedSecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call whose metadata does not carry the secret (compared in constant time)."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a shared-secret check needs a secret")
        self._secret = secret.encode()
        self._refuse = grpc.unary_unary_rpc_method_handler(_unauthenticated)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if self.is_allowed(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        CALLS_REFUSED.inc()
        log.warning("refused a gRPC call to %s: no valid internal secret", handler_call_details.method)
        return self._refuse

    def is_allowed(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == SECRET_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._secret)
        return False


async def _unauthenticated(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call needs the internal secret (TANDEM_INTERNAL_SECRET)")


# Under mutual TLS, the roles whose certificate may call each service: only a prefill worker
# hands a decode worker KV, only the operator's tools (and a router) drive WorkerControl.
CALLER_ROLES = {"tandem.v1.KvHandoff": frozenset({"prefill"}), "tandem.v1.WorkerControl": frozenset({"operator", "router"})}
CALLS_FORBIDDEN = Counter(
    "tandem_grpc_calls_forbidden_total", "gRPC calls refused for a client certificate of a role not allowed the service"
)


class CallerRoleInterceptor(grpc.aio.ServerInterceptor):
    """Under mutual TLS: serves a call only when the caller's certificate (its common name,
    <role>.tandem.internal) is of a role CALLER_ROLES allows for the service; else
    PERMISSION_DENIED before the handler runs. Every method of both services is unary."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        allowed = CALLER_ROLES.get(method.strip("/").split("/")[0])
        if handler is None or allowed is None or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            role = caller_role(context)
            if role not in allowed:
                CALLS_FORBIDDEN.inc()
                log.warning("refused a gRPC call to %s from a %r certificate", method, role)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this certificate's role may not call this service")
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            checked, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def caller_role(context: grpc.aio.ServicerContext) -> str:
    """The role named by the caller's certificate ("" without one): prefill.tandem.internal, or an
    instance's prefill-0.prefill.tandem.internal (containers' certificates, whose instance ids
    hold no dot: tandem.bus.permissions.cert_user)."""
    names = context.auth_context().get("x509_common_name", [])
    return names[0].decode().removesuffix(f".{INTERNAL_DOMAIN}").rsplit(".", 1)[-1] if names else ""


def is_loopback_host(host: str) -> bool:
    """Only this machine can connect to it: `localhost` or a loopback address. A wildcard, another
    address or any other name may be reachable from elsewhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def check_internal_secret(host: str, secret: str, *, is_insecure_allowed: bool) -> None:
    """A worker may listen without the internal secret only on a loopback host, or when the
    operator said so (`is_insecure_allowed`, logged); else a StartupError says what to set."""
    if secret or is_loopback_host(host):
        return
    if is_insecure_allowed:
        log.warning("TANDEM_INTERNAL_SECRET is empty on %s (allowed by TANDEM_ALLOW_INSECURE_INTERNAL): gRPC calls are not checked", host)
        return
    raise StartupError(
        f"TANDEM_HOST is {host!r}, which other machines can reach, and TANDEM_INTERNAL_SECRET is empty: anyone reaching the "
        "gRPC port could drain this worker or reserve its KV blocks. Set TANDEM_INTERNAL_SECRET (`tandem secrets DIR` makes one), "
        "listen on 127.0.0.1, or set TANDEM_ALLOW_INSECURE_INTERNAL=1 to run without it"
    )


def server_interceptors(secret: str, is_mutual_tls: bool = False) -> list[grpc.aio.ServerInterceptor]:
    by_secret: list[grpc.aio.ServerInterceptor] = [SharedSecretInterceptor(secret)] if secret else []
    return [*by_secret, CallerRoleInterceptor()] if is_mutual_tls else by_secret


class _WithSecret(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._entry = (SECRET_METADATA_KEY, secret)

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        details = client_call_details
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        with_secret = grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready)
        return await continuation(with_secret, request)


def internal_channel(address: str, secret: str, tls: TlsSettings | None = None, peer_role: str = "") -> grpc.aio.Channel:
    """A channel to a worker's gRPC port whose every call carries the secret (none when empty).
    With `tls` it is mutual TLS, and the server must hold `peer_role`'s certificate
    (decode.tandem.internal) whatever `address` is: an address from a spoofed heartbeat leads to
    no handshake, so the secret is never sent there."""
    interceptors = [_WithSecret(secret)] if secret else None
    if tls is None or not tls.is_enabled:
        return grpc.aio.insecure_channel(address, interceptors=interceptors)
    options = [("grpc.ssl_target_name_override", server_name(peer_role))]
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=options, interceptors=interceptors)


def _pem_files(tls: TlsSettings) -> tuple[bytes, bytes, bytes]:
    return Path(tls.ca_file).read_bytes(), Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes()


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """Mutual TLS: a caller without a certificate of the CA gets no handshake (nor a plaintext one)."""
    ca, key, cert = _pem_files(tls)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials:
    ca, key, cert = _pem_files(tls)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
