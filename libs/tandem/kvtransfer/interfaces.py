"""Keeps UCX's TCP listening sockets on the worker's configured address.

Besides the KV listener, every UCX worker with the TCP transport listens on each network device it
uses (UCX_NET_DEVICES, default all), so a worker bound to 127.0.0.1 would still listen on the
machine's other addresses. Before ucxx starts, a worker narrows UCX_NET_DEVICES to the interface
that holds its host address (plus the RDMA devices, which open no TCP socket), unless the operator
set UCX_NET_DEVICES. A wildcard host leaves UCX alone.

The KV listener itself: libucxx can bind it to an address, but the Python ucxx (0.52) creates it
without one, on every interface. So once it listens, bind_listener_to_host finds its socket among
this process's descriptors and binds it to the interface that holds the host address
(SO_BINDTODEVICE; `ss -ltn` shows 0.0.0.0%lo): a connection arriving on another interface is
refused. It is a device, not an address: another address of the same interface is let in.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import re
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


def bind_listener_to_host(port: int, host: str) -> str | None:
    """Binds this process's TCP sockets that listen on `port` to the interface that holds `host`;
    returns the interface, or None when there is nothing to do (a wildcard or a name) or it could
    not be done (logged: the listener then stays on every interface)."""
    if host in _WILDCARDS:
        return None
    try:
        interface = interface_of(ipaddress.ip_address(host))
    except ValueError:
        log.warning("the KV listener stays on every interface: %r is a name, not an address", host)
        return None
    fds = _listening_fds(port)
    if interface is None or not fds:
        log.warning("the KV listener stays on every interface: no %s", "interface holds " + host if interface is None else "socket found")
        return None
    for fd in fds:
        bound = socket.socket(fileno=os.dup(fd))  # the same socket; closing the duplicate leaves UCX's open
        try:
            bound.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode())
        except OSError as exc:
            log.warning("the KV listener stays on every interface: binding it to %s failed (%s)", interface, exc.strerror)
            return None
        finally:
            bound.close()
    return interface


def _listening_fds(port: int) -> list[int]:
    """This process's descriptors of TCP sockets listening on `port` (any address)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: TCP_LISTEN
                inodes.add(int(fields[9]))
    fds = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:  # closed meanwhile
            continue
        if match and int(match[1]) in inodes:
            fds.append(int(fd.name))
    return fds
