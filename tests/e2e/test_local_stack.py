"""`make run` (that is, `tandem up`): every process comes up, /readyz answers through the chat
port, a SIGKILLed service is reported and restarted, and Ctrl-C leaves nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from helpers import REPO, interrupt_and_wait

from tandem.devstack.proc import ChildProcess, free_port

pytestmark = pytest.mark.e2e

UP_TIMEOUT_S = 180
ROLES = ("router", "relay", "prefill", "decode", "chat")


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, only not yet reaped
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _chat_over_http(url: str, api_key: str) -> None:
    """A person's path: the page loads, a conversation is made, a message streams its answer."""
    headers = {"Authorization": f"Bearer {api_key}"}
    assert "<html" in httpx.get(url, timeout=10).text.lower()
    conversation = httpx.post(f"{url}/v1/conversations", headers=headers, json={}, timeout=10)
    assert conversation.status_code == 201, conversation.text
    body = {"content": "What is the capital of France?", "temperature": 0, "max_tokens": 16}
    with httpx.stream(
        "POST", f"{url}/v1/conversations/{conversation.json()['id']}/messages", headers=headers, json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[0] == "meta" and events[-1] == "done", lines
    assert "Paris" in "".join(line for line in lines if line.startswith("data: ")), lines


def test_make_run_restarts_a_killed_service_and_ctrl_c_leaves_nothing_behind():
    env = {**_env(), "TANDEM_HTTP_PORT": str(free_port())}
    up = ChildProcess("make", ["make", "--no-print-directory", "run"], env=env, cwd=str(REPO))
    up.start()  # in a session of its own: killpg below is a terminal's Ctrl-C
    pids: dict[str, int] = {}
    try:
        ready = up.wait_for_line(r"Tandem is up at (http://\S+)", UP_TIMEOUT_S)
        assert ready is not None, up.recent_output(40)
        launcher = up.wait_for_line(r"^up\s*\| starting the local stack \(pid (\d+)\)", 1)
        assert launcher is not None
        pids["tandem up"] = int(launcher[1])
        for name in (*ROLES, "nats", "redis"):
            started = up.wait_for_line(rf"^up\s*\| {name} started \(pid (\d+)\)", 1)
            assert started is not None, f"no start line for {name}"
            pids[name] = int(started[1])
            assert _is_running(pids[name]), name
        api_key = up.wait_for_line(r"API key: (tdm-dev-\S+)", 1)
        assert api_key is not None
        assert httpx.get(f"{ready[1]}/readyz", timeout=10).status_code == 200
        _chat_over_http(ready[1], api_key[1])
        nats_url = up.wait_for_line(r"internal clients: TANDEM_NATS_URL=(\S+)", 1)
        assert nats_url is not None
        answer = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "generate", "--via-bus", "What is the capital of France?"],
            env={**_env(), "TANDEM_NATS_URL": nats_url[1]},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert answer.returncode == 0, answer.stderr
        assert "Paris" in answer.stdout, "router -> decode worker -> TokenEvents, over the stack's NATS"

        mark = up.num_lines
        os.kill(pids["decode"], signal.SIGKILL)
        reported = up.wait_for_line(r"decode exited \(killed by SIGKILL\); restarting in (\d+) s", 60, since=mark)
        assert reported is not None, up.recent_output(40)
        restarted = up.wait_for_line(r"^up\s*\| decode started \(pid (\d+)\)", 60, since=mark)
        assert restarted is not None, up.recent_output(40)
        assert int(restarted[1]) != pids["decode"]
        pids["decode (restarted)"] = int(restarted[1])
        assert up.wait_for_line(r"^up\s*\| decode ready", UP_TIMEOUT_S, since=mark) is not None
        assert httpx.get(f"{ready[1]}/readyz", timeout=10).status_code == 200
    finally:
        interrupt_and_wait(up)
    assert up.wait_for_line(r"^up\s*\| stopped; nothing left running", 1) is not None, up.recent_output(40)
    left = {name: pid for name, pid in pids.items() if _is_running(pid)}
    assert not left, f"still running after Ctrl-C: {left}"


def test_up_refuses_a_malformed_key_list_in_one_line():
    env = {**_env(), "TANDEM_API_KEYS": "key-without-user"}
    result = subprocess.run([sys.executable, "-m", "tandem.cli", "up"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tandem up: error: TANDEM_API_KEYS: entry 'key-without-user' must look like key=user:tier (tier one of free, plus, pro)"
    ]
    assert result.stdout == ""


def test_up_refuses_a_busy_chat_port_before_starting_anything():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "up", "--port", str(port)],
            env=_env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"tandem up: error: chat: port {port} on 127.0.0.1 is in use: stop what holds it or set TANDEM_HTTP_PORT or --port"
    )
    assert "started" not in result.stdout
