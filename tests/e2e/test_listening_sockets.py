"""`tandem up` on 127.0.0.1 listens on loopback only: every TCP socket that the stack's processes
(launcher, NATS, Redis, every service, after a reply that went through a KV handoff) listen on is
on a loopback address, or bound to the loopback device (the decode worker's ucxx KV listener,
which the Python ucxx creates on every address: tandem.kvtransfer.interfaces)."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
from helpers import REPO, interrupt_and_wait

from tandem.devstack.proc import ChildProcess, free_port

UP_TIMEOUT_S = 180
LONG_PROMPT = " ".join(f"item {i} is a word;" for i in range(120))  # well over the 256 tokens that go to a prefill worker


@dataclass(frozen=True)
class Listening:
    pid: int
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    device: str  # SO_BINDTODEVICE's interface, or ""

    @property
    def is_loopback(self) -> bool:
        return self.address.is_loopback or self.device == "lo"


def _parse(local: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, str]:
    """ss's local address: 127.0.0.1:8080, [::ffff:127.0.0.1]:41, *:22, 0.0.0.0%lo:5000, [::]%lo:5000."""
    host, port = local.rsplit(":", 1)
    host, _, device = host.partition("%")
    host = host.strip("[]")
    address = ipaddress.ip_address("0.0.0.0" if host == "*" else host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # as UCX's TCP transport listens
    return address, int(port), device


def _descendants(root: int) -> set[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            after_name = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        parents[int(stat.parent.name)] = int(after_name[1])
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def listening_sockets(root: int) -> list[Listening]:
    """Every TCP socket that `root` or a process below it listens on (`ss`, which also shows a
    socket's bound device, as /proc/net/tcp does not)."""
    tree = _descendants(root)
    table = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True, timeout=30).stdout
    sockets = []
    for line in table.splitlines():
        fields = line.split()
        for pid in {int(p) for p in re.findall(r"pid=(\d+)", line)} & tree:
            sockets.append(Listening(pid, *_parse(fields[3])))
    return sockets


def _handoff_reply(url: str, api_key: str) -> None:
    """A reply long enough for a prefill worker, so both workers' UCX transports are up."""
    headers = {"Authorization": f"Bearer {api_key}"}
    conversation = httpx.post(f"{url}/v1/conversations", headers=headers, json={}, timeout=10)
    assert conversation.status_code == 201, conversation.text
    body = {"content": LONG_PROMPT, "temperature": 0, "max_tokens": 4}
    path = f"{url}/v1/conversations/{conversation.json()['id']}/messages"
    with httpx.stream("POST", path, headers=headers, json=body, timeout=180) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())
    assert "event: done" in lines, lines


def test_tandem_up_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update(PYTHONUNBUFFERED="1", TANDEM_HOST="127.0.0.1")
    up = ChildProcess("up", [sys.executable, "-m", "tandem.cli", "up", "--port", str(free_port())], env=env, cwd=str(REPO))
    up.start()
    try:
        ready = up.wait_for_line(r"Tandem is up at (http://\S+)", UP_TIMEOUT_S)
        assert ready is not None, up.recent_output(40)
        api_key = up.wait_for_line(r"API key: (tdm-dev-\S+)", 1)
        assert api_key is not None
        decode = up.wait_for_line(r"^up\s*\| decode started \(pid (\d+)\)", 1)
        assert decode is not None
        _handoff_reply(ready[1], api_key[1])

        sockets = listening_sockets(up.pid)
        off_loopback = [s for s in sockets if not s.is_loopback]
    finally:
        interrupt_and_wait(up)
    assert len({s.pid for s in sockets}) >= 7, sockets  # nats, redis, router, relay, prefill, decode, chat
    assert not off_loopback, off_loopback
    assert any(s.pid == int(decode[1]) and s.device == "lo" for s in sockets), "the KV listener is bound to lo"
