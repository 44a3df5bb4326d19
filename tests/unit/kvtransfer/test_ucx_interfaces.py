"""A worker narrows UCX's network devices to the interface of its host before ucxx starts, and
leaves them alone for a wildcard host, a host name, or a UCX_NET_DEVICES the operator set."""

from __future__ import annotations

import ipaddress

from tandem.kvtransfer.interfaces import interface_of, restrict_ucx_to_host


def test_loopback_is_found_on_lo_and_an_address_nobody_holds_on_no_interface():
    assert interface_of(ipaddress.ip_address("127.0.0.1")) == "lo"
    assert interface_of(ipaddress.ip_address("192.0.2.254")) is None  # TEST-NET-1: held by no interface


def test_a_loopback_host_keeps_ucx_on_lo():
    env: dict[str, str] = {}
    assert restrict_ucx_to_host("127.0.0.1", env) == env["UCX_NET_DEVICES"]
    assert env["UCX_NET_DEVICES"].split(",")[0] == "lo"


def test_the_operators_setting_a_wildcard_and_a_name_are_left_alone():
    for host, env in (("127.0.0.1", {"UCX_NET_DEVICES": "mlx5_0:1"}), ("0.0.0.0", {}), ("::", {}), ("decode-0", {})):
        before = dict(env)
        assert restrict_ucx_to_host(host, env) is None
        assert env == before
