"""The `nats` certificate names every address a route dials (nats-server checks a route's peer
by the address in its URL), and no other service's certificate is given those addresses."""

from pathlib import Path

from cryptography import x509

from tandem.devstack.certs import CertSet, make_cert_set
from tandem.devstack.servers import plan_nats_cluster


def _ip_names(made: CertSet, service: str) -> set[str]:
    cert = x509.load_pem_x509_certificate(made.cert_file(service).read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(address) for address in names.get_values_for_type(x509.IPAddress)}


def test_the_nats_certificate_names_the_addresses_its_routes_dial(tmp_path: Path) -> None:
    made = make_cert_set(tmp_path, services=("nats", "chat"), addresses={"nats": ["10.77.3.2", "10.77.3.3"]})
    loopback_nodes = {node.host for node in plan_nats_cluster(3)}
    assert loopback_nodes | {"10.77.3.2", "10.77.3.3"} <= _ip_names(made, "nats")
    assert _ip_names(made, "chat") == {"127.0.0.1", "::1"}, "only nats is given the nodes' addresses"
