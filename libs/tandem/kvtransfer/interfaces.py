"""Keeps UCX's own TCP listening sockets on the worker's configured address.

Besides the KV listener, every UCX worker with the TCP transport listens on each network device it
uses (UCX_NET_DEVICES, default all), so a worker bound to 127.0.0.1 would still listen on the
machine's other addresses. Before ucxx starts, a worker narrows UCX_NET_DEVICES to the interface
that holds its host address (plus the RDMA devices, which open no TCP socket), unless the operator
set UCX_NET_DEVICES. A wildcard host leaves UCX alone.

What this cannot do: the Python ucxx (0.52) creates the KV listener without an address, so that one
socket listens on every interface whatever UCX_NET_DEVICES says; the reservation token keeps other
peers from writing into reserved blocks through it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915
_WILDCARDS = {"", "0.0.0.0", "::"}


def restrict_ucx_to_host(host: str, environ: dict[str, str] | None = None) -> str | None:
    """Sets UCX_NET_DEVICES for `host` (before ucxx starts); returns what it set, or None when it
    left it alone (set already, a wildcard or a name, no interface holds the address)."""
    env = os.environ if environ is None else environ
    if "UCX_NET_DEVICES" in env or host in _WILDCARDS:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None  # a host name: nothing to match against interfaces
    interface = interface_of(address)
    if interface is None:
        log.warning("no network interface holds %s; UCX uses all of them", host)
        return None
    devices = ",".join([interface, *_rdma_devices()])
    env["UCX_NET_DEVICES"] = devices
    return devices


def interface_of(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The name of the interface that holds the address (lo for 127.0.0.1), or None."""
    if address.version == 6:
        return _ipv6_interface(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(reply[20:24]) == str(address):
                return name
    return None


def _ipv6_interface(address: ipaddress.IPv6Address) -> str | None:
    table = Path("/proc/net/if_inet6")
    if not table.exists():
        return None
    for line in table.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0] == address.exploded.replace(":", ""):
            return fields[5]
    return None


def _rdma_devices() -> list[str]:
    """RDMA devices as UCX names them (mlx5_0:1): they carry KV without any TCP socket."""
    root = Path("/sys/class/infiniband")
    if not root.is_dir():
        return []
    return [f"{dev.name}:{port.name}" for dev in sorted(root.iterdir()) for port in sorted((dev / "ports").glob("*"))]
