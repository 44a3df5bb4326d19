"""A development CA and a certificate per service, made with `cryptography`: `tandem up` makes a
set in its work folder at every start, `tandem secrets DIR` one for containers (DIR/tls/, which
compose mounts). Keys are EC P-256, made fresh each time; the CA's key is never written: a new set
(a rotation) is a new CA, and nothing can issue another certificate under the old one.

Each certificate names its service three ways (SANs): `nats`, `nats.tandem.internal` (what
clients verify, tandem.tls.server_name, whatever address they dialed) and localhost with the
loopback addresses (and, on hosts of their own, the addresses of a server's nodes: a NATS route
or a Redis replica or sentinel checks the node it dials by the address it dialed, and a
sentinel names a primary by its address); it serves and it calls (serverAuth and clientAuth), since a worker's gRPC
port is mutual. Kubernetes gets the same names from cert-manager (deploy/k8s/tls, and each service
pod's own from cert-manager's csi-driver). A service instance's certificate (containers: compose's
`decode-0`) carries one name more, its instance's (tandem.bus.permissions.cert_user), which
nats-server maps to the instance's bus user."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tandem.bus.permissions import Identity, cert_user
from tandem.tls import TlsSettings, server_name

# Every process that holds a certificate: the servers, the services, and `operator` for tools
# (tandem bus init, tandem top) run beside a stack.
SERVICES = ("nats", "redis", "cassandra", "router", "relay", "chat", "prefill", "decode", "operator")
CA_FILE = "ca.pem"
FOLDER = "tls"
VALID_DAYS = 365
_CLOCK_SKEW = datetime.timedelta(minutes=5)  # valid a little before now: a peer's clock may lag


@dataclass(frozen=True)
class CertSet:
    """A set's files under `folder`: ca.pem, and <service>.pem with <service>.key for each service."""

    folder: Path

    @property
    def ca_file(self) -> Path:
        return self.folder / CA_FILE

    def cert_file(self, service: str) -> Path:
        return self.folder / f"{service}.pem"

    def key_file(self, service: str) -> Path:
        return self.folder / f"{service}.key"

    def settings(self, service: str) -> TlsSettings:
        """What a process of `service` is given (its TANDEM_TLS_* variables)."""
        return TlsSettings(ca_file=str(self.ca_file), cert_file=str(self.cert_file(service)), key_file=str(self.key_file(service)))


def make_cert_set(
    parent: Path,
    services: tuple[str, ...] = SERVICES,
    valid_days: int = VALID_DAYS,
    instances: Sequence[Identity] = (),
    addresses: Mapping[str, Sequence[str]] | None = None,
) -> CertSet:
    """A new CA and one certificate per service under `parent`/tls (replacing what was there), and
    one per instance of `instances`, under its instance id's name (decode-0.pem). `addresses`:
    a service's addresses off loopback (`nats` and `redis` on hosts of their own), which its
    certificate names too."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"Tandem development CA {now:%Y-%m-%d %H:%M:%S}")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), now, valid_days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(is_ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    made = CertSet(parent / FOLDER)
    made.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    made.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    addresses = addresses or {}
    holders = [(service, server_name(service), _names(service, addresses=addresses.get(service, ()))) for service in services]
    holders += [(i.instance_id, cert_user(i), _names(i.role, cert_user(i))) for i in instances]
    for holder, common_name, names in holders:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        cert = (
            _builder(subject, ca.subject, key.public_key(), now, valid_days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(is_ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(names, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        made.cert_file(holder).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        _write_key(made.key_file(holder), key_pem)
    return made


def _write_key(path: Path, pem: bytes) -> None:
    """Readable by this user alone from the start (tandem secrets imports this module, so its
    write_private cannot be used here)."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(pem)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, now: datetime.datetime, valid_days: int
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=valid_days))
    )


def _key_usage(is_ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not is_ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not is_ca,
        key_cert_sign=is_ca,
        crl_sign=is_ca,
        encipher_only=False,
        decipher_only=False,
    )


def _names(service: str, *more: str, addresses: Sequence[str] = ()) -> x509.SubjectAlternativeName:
    dns = [x509.DNSName(name) for name in (service, server_name(service), *more, "localhost")]
    ips = [x509.IPAddress(ipaddress.ip_address(address)) for address in ("127.0.0.1", "::1", *addresses)]
    return x509.SubjectAlternativeName([*dns, *ips])


def nats_tls_config(tls: TlsSettings) -> str:
    """nats-server's `tls` block: every client must speak TLS and show a certificate of the CA
    (`verify`); a plaintext one is refused before it can log in. The same block inside `cluster`
    does it for the routes between nodes: each side shows the `nats` certificate, and the one that
    dials checks the other's against the address it dialed."""
    return (
        "tls {\n"
        f"  cert_file: {json.dumps(tls.cert_file)}\n"
        f"  key_file: {json.dumps(tls.key_file)}\n"
        f"  ca_file: {json.dumps(tls.ca_file)}\n"
        "  verify: true\n"
        "  timeout: 2\n"
        "}\n"
    )
