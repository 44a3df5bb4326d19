"""Hosts of their own for a local stack's processes: one Linux network namespace per host, each
with one address on a bridge shared by all (a veth pair per host: one end, `eth0`, in the host's
namespace; the other on the bridge). The machine itself is on the bridge too (its first address),
so the launcher and drill clients reach every host. A host can be cut off the network (its link
down: every packet to and from it dropped, as when a host's network fails) and healed, and two
hosts can be cut off from each other alone (both bridge ports isolated: a partition between two
hosts that each still reach the rest).

It needs root (CAP_NET_ADMIN) and iproute2's `ip` and `bridge`; the failure drills use it
(bench/drills.py --hosts). A process runs on a host through `ip netns exec`, which executes it in
the host's namespace as the same process: its pid is the one to signal.

    with HostNetwork() as network:
        relay = network.add("relay")          # Host(name="relay", address="10.77.3.4", ...)
        argv = [*relay.prefix, sys.executable, "-m", "services.relay"]
        network.cut(relay); network.heal(relay)
        network.separate(relay, redis); network.join(relay, redis)
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from types import TracebackType

from tandem.errors import StartupError

_NETWORKS = ipaddress.ip_network("10.77.0.0/16")  # each stack takes a /24 of it no route here uses
_MAX_HOSTS = 250
_COMMAND_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    port_device: str  # its veth end on the bridge, in the machine's namespace

    @property
    def prefix(self) -> list[str]:
        """What runs a command on this host."""
        return ["ip", "netns", "exec", self.namespace]


def can_make_hosts() -> str:
    """ "" when this process can make hosts; else why not."""
    if os.geteuid() != 0:
        return "separate hosts need root (network namespaces)"
    for tool in ("ip", "bridge"):
        if shutil.which(tool) is None:
            return f"separate hosts need iproute2's `{tool}`"
    return ""


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise StartupError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")


def _taken_subnets() -> set[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    result = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=True)
    taken = set()
    for line in result.stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            taken.add(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    return taken


class HostNetwork:
    """A bridge and the hosts on it; `close` (or leaving the `with`) removes every namespace,
    link and address it made."""

    def __init__(self) -> None:
        why_not = can_make_hosts()
        if why_not:
            raise StartupError(why_not)
        self._tag = secrets.token_hex(3)  # names of at most 15 characters, unique per stack
        self.bridge = f"tb{self._tag}"
        taken = _taken_subnets()
        free = [net for net in _NETWORKS.subnets(new_prefix=24) if not any(net.overlaps(other) for other in taken)]
        if not free:
            raise StartupError(f"no free /24 left in {_NETWORKS} for the hosts' bridge")
        self.subnet = free[secrets.randbelow(len(free))]
        self._addresses = self.subnet.hosts()
        self.gateway = str(next(self._addresses))  # the machine's own address on the bridge
        self.hosts: dict[str, Host] = {}
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        try:
            _run("ip", "addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except StartupError:
            self.close()
            raise

    def add(self, name: str) -> Host:
        """A new host named `name`, up, with an address of its own."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists already")
        if len(self.hosts) >= _MAX_HOSTS:
            raise StartupError(f"at most {_MAX_HOSTS} hosts")
        index = len(self.hosts)
        host = Host(name, f"tandem-{self._tag}-{name}", str(next(self._addresses)), f"tv{self._tag}{index}")
        self.hosts[name] = host
        prefix = f"{host.address}/{self.subnet.prefixlen}"
        _run("ip", "netns", "add", host.namespace)
        _run("ip", "link", "add", host.port_device, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        _run("ip", "link", "set", host.port_device, "master", self.bridge, "up")
        _run("ip", "-n", host.namespace, "addr", "add", prefix, "dev", "eth0")
        _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
        return host

    def cut(self, host: Host) -> None:
        """The host's link goes down: nothing reaches it and nothing leaves it."""
        _run("ip", "link", "set", host.port_device, "down")

    def heal(self, host: Host) -> None:
        _run("ip", "link", "set", host.port_device, "up")

    def separate(self, one: Host, other: Host) -> None:
        """A partition between `one` and `other` alone: their bridge ports are isolated, and
        isolated ports do not forward to each other (each still reaches every other host). Only
        one pair at a time is separated."""
        for host in (one, other):
            _run("bridge", "link", "set", "dev", host.port_device, "isolated", "on")

    def join(self, one: Host, other: Host) -> None:
        for host in (one, other):
            _run("bridge", "link", "set", "dev", host.port_device, "isolated", "off")

    def close(self) -> None:
        """Removes every host (its namespace, and with it its veth pair) and the bridge."""
        for host in self.hosts.values():
            # The pair goes with its end here at once; with the namespace it goes only once the
            # kernel's cleanup gets to it, later.
            subprocess.run(["ip", "link", "del", host.port_device], capture_output=True, timeout=_COMMAND_TIMEOUT_S, check=False)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=_COMMAND_TIMEOUT_S, check=False)
        self.hosts = {}
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=_COMMAND_TIMEOUT_S, check=False)

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
