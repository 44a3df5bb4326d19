"""API keys against a real chat process (real NATS and Redis): the keys file holds salted hashes
only (written by `tandem keys`), a key added or revoked there counts within 5 s with no restart,
a file line for a key under the minimum strength stops the chat at start, and an address that
sends wrong keys is refused with 429 and Retry-After while others go on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import REPO, next_heartbeat, service_env, service_process, wait_until

from tandem.api_keys import ApiKey, Tier
from tandem.devstack.proc import ChildProcess
from tandem.devstack.servers import EmbeddedServer
from tandem.key_file import entry_for

RELOAD_BOUND_S = 5.0
LIST = "/v1/conversations"


def tandem_keys(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "keys", *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    return result.stdout.strip()


@pytest.fixture
def start_chat(nats_server: EmbeddedServer, redis_server: EmbeddedServer, tmp_path: Path) -> Iterator:
    started: list[ChildProcess] = []

    def start(**extra: str) -> tuple[ChildProcess, dict[str, str]]:
        env = service_env("chat", nats_server.url, redis_server.url, TANDEM_SQLITE_PATH=str(tmp_path / "c.db"), **extra)
        child = service_process("chat", env)
        child.start()
        started.append(child)
        return child, env

    yield start
    for child in started:
        child.stop(timeout_s=10)


async def started_chat(start_chat, nc, **extra: str) -> tuple[ChildProcess, str]:
    child, env = start_chat(**extra)
    await next_heartbeat(nc, "chat", env["TANDEM_INSTANCE_ID"], accept=lambda hb: hb.is_ready)
    return child, f"http://127.0.0.1:{env['TANDEM_HTTP_PORT']}"


async def status_of(http: httpx.AsyncClient, key: str) -> int:
    return (await http.get(LIST, headers={"Authorization": f"Bearer {key}"})).status_code


async def test_keys_file_holds_no_key_and_an_added_or_revoked_key_counts_within_5_s_without_a_restart(start_chat, nc, tmp_path):
    keys_file = tmp_path / "api-keys"
    alice = tandem_keys("add", str(keys_file), "--user", "alice", "--tier", "plus")
    text = keys_file.read_text()
    assert alice.split(".")[0] in text  # its id is there, the key and its secret are not
    assert alice not in text and alice.split(".", 1)[1] not in text
    child, url = await started_chat(start_chat, nc, TANDEM_API_KEYS="", TANDEM_API_KEYS_FILE=str(keys_file))
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        assert await status_of(http, alice) == 200
        assert await status_of(http, "tdm-not.yet-added") == 401
        bob = tandem_keys("add", str(keys_file), "--user", "bob", "--tier", "free")
        await within_reload_bound(lambda: _is(http, bob, 200))
        tandem_keys("revoke", str(keys_file), alice.split(".")[0])
        await within_reload_bound(lambda: _is(http, alice, 401))
        assert await status_of(http, bob) == 200  # the revocation took alice's key alone
    assert child.process.poll() is None  # the same process throughout: no restart


async def _is(http: httpx.AsyncClient, key: str, status: int) -> bool:
    return await status_of(http, key) == status


async def within_reload_bound(check) -> None:
    """`check` comes true within RELOAD_BOUND_S of now (the file was just written)."""
    written_s = asyncio.get_running_loop().time()
    await wait_until(check, timeout_s=RELOAD_BOUND_S, interval_s=0.1)
    assert asyncio.get_running_loop().time() - written_s <= RELOAD_BOUND_S


def test_a_key_file_line_for_a_short_key_stops_the_chat_at_start(nats_server, redis_server, tmp_path):
    keys_file = tmp_path / "api-keys"
    long_key = tandem_keys("add", str(keys_file), "--user", "alice")
    short = entry_for("tdm-short.abcdefghijklmnop", ApiKey(user_id="bob", tier=Tier.PRO))  # 12 random bytes
    keys_file.write_text(keys_file.read_text() + short.line() + "\n")
    env = service_env(
        "chat", nats_server.url, redis_server.url, TANDEM_API_KEYS_FILE=str(keys_file), TANDEM_SQLITE_PATH=str(tmp_path / "c.db")
    )
    result = subprocess.run([sys.executable, "-m", "services.chat"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem chat: error: TANDEM_API_KEYS_FILE: "), result.stderr
    assert "line 2" in lines[0] and "'tdm-short'" in lines[0] and "under the minimum 32" in lines[0]
    assert long_key not in result.stderr + result.stdout


async def test_wrong_keys_from_one_address_get_429_with_retry_after_while_another_address_goes_on(start_chat, nc):
    good = "tdm-test.a-key-given-in-the-environment"  # the development form, hashed at start
    _, url = await started_chat(
        start_chat, nc, TANDEM_API_KEYS=f"{good}=alice:plus", TANDEM_AUTH_MAX_FAILURES="3", TANDEM_AUTH_FAILURE_WINDOW_S="60"
    )
    guesser = httpx.AsyncHTTPTransport(local_address="127.0.0.2")  # loopback: a second client address
    async with httpx.AsyncClient(base_url=url, transport=guesser, timeout=10) as other, httpx.AsyncClient(base_url=url, timeout=10) as http:
        for wrong in ("tdm-test.guess-1", "no-such-key", "tdm-test.guess-2"):  # a known key id and an unknown
            assert await status_of(other, wrong) == 401
        refused = await other.get(LIST, headers={"Authorization": "Bearer tdm-test.guess-3"})
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "too_many_failed_keys"
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert await status_of(other, good) == 429  # not even a good key is looked at from there
        assert await status_of(http, good) == 200  # 127.0.0.1 goes on
        assert await status_of(http, "tdm-test.wrong") == 401
