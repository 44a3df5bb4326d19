"""TLS on the internal links: where a process finds its certificate, and the client and server
contexts built from it for NATS (gRPC's credentials: tandem.worker.internal_grpc, the one place
grpc is installed; Redis takes its CA from a `rediss://` URL's ssl_ca_certs; Cassandra's store its
own, TANDEM_CASSANDRA_CA_FILE, in tandem.store.cassandra_session). tandem.devstack.certs makes the files; docs/security.md says what each protects.

Every internal name is verified against the deployment's own CA, never the system's: a NATS
client checks that the server holds the `nats` certificate (SERVER_NAMES) whatever address it
dialed, and a prefill worker that the decode worker it dials holds the `decode` one, so a
spoofed heartbeat's address gets no handshake from anyone else. gRPC is mutual: a worker's
server asks every caller for a certificate of the same CA. Unset (a bare `tandem serve`, most
tests' servers) the links stay in clear, as before."""

from __future__ import annotations

import ssl
from pathlib import Path

from pydantic import model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

INTERNAL_DOMAIN = "tandem.internal"


def server_name(service: str) -> str:
    """The name a client verifies on `service`'s certificate (nats.tandem.internal)."""
    return f"{service}.{INTERNAL_DOMAIN}"


class TlsSettings(BaseSettings):
    """This process's CA, certificate and key (PEM files); no CA: the internal links run in clear."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_TLS_", frozen=True, extra="ignore", use_attribute_docstrings=True)

    ca_file: str = ""
    """PEM file of the CA every internal certificate is checked against; empty: no TLS"""
    cert_file: str = ""
    """PEM file of this process's certificate (its role's: chat, relay, router, prefill, decode)"""
    key_file: str = ""
    """PEM file of that certificate's key"""

    @model_validator(mode="after")
    def _files_exist(self) -> TlsSettings:
        """A half-set certificate or a missing file fails at start, naming the setting."""
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("set TANDEM_TLS_CERT_FILE and TANDEM_TLS_KEY_FILE together")
        for name, path in (("CA", self.ca_file), ("CERT", self.cert_file), ("KEY", self.key_file)):
            if path and not Path(path).is_file():
                raise ValueError(f"TANDEM_TLS_{name}_FILE: no file at {path}")
        return self

    @property
    def is_enabled(self) -> bool:
        return bool(self.ca_file)

    def env(self) -> dict[str, str]:
        """These settings as the variables a child process reads."""
        return {"TANDEM_TLS_CA_FILE": self.ca_file, "TANDEM_TLS_CERT_FILE": self.cert_file, "TANDEM_TLS_KEY_FILE": self.key_file}

    def client_context(self) -> ssl.SSLContext:
        """Verifies the peer against the CA alone (TLS 1.2 at least) and shows our certificate
        when we have one."""
        context = verifying_context(self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


def verifying_context(ca_file: str) -> ssl.SSLContext:
    """A client context that checks the server's certificate and name against `ca_file` alone
    (TLS 1.2 at least), showing no certificate of its own (Cassandra's clients log in with a password)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)  # with a cafile: no system roots
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def nats_tls_options(tls: TlsSettings | None) -> dict[str, object]:
    """nats.connect's keyword arguments for `tls`: none when TLS is off."""
    if tls is None or not tls.is_enabled:
        return {}
    return {"tls": tls.client_context(), "tls_hostname": server_name("nats")}
