"""The product stack for e2e tests: router, a decode worker, two relays and two chat instances,
each a real process on the session's real nats-server and redis-server, with a SQLite store.
Tests talk to it over HTTP/SSE as a client would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats
from helpers import next_heartbeat, ops_url, service_env, service_process, wait_until

from tandem.devstack.proc import ChildProcess
from tandem.devstack.servers import EmbeddedServer, init_token_stream, start_nats, start_redis

API_KEYS = "key-alice=alice:plus,key-bob=bob:free,key-carol=carol:plus"
ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}
CAROL = {"Authorization": "Bearer key-carol"}  # the usage ledger's user: no other test's messages are hers
READER_IDLE_TIMEOUT_S = 4.0

# The lean stack's settings (tests/e2e/conftest.py), which the modules that use it read as well.
LEAN_ROLES = ("router", "decode", "relay", "chat")
BLOCKED = "kumquat"  # its output check's one word: SmolLM2 repeats it when asked to; nothing else says it
LEAN_PROMPT_BUDGET_FREE = 300
LEAN_MAX_ANSWER_TOKENS = 24  # a free prompt of 276 tokens
LEAN_SUMMARY_MAX_TOKENS = 40


@dataclass
class ProductStack:
    chat_urls: list[str]
    ids: dict[str, list[str]]
    store_path: Path
    nats_url: str
    redis_url: str
    children: list[ChildProcess] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)  # each instance's HTTP port: its API (the router's /workers)
    ops_urls: dict[str, str] = field(default_factory=dict)  # each instance's ops port: /healthz, /readyz, /metrics, /version
    nats_server: EmbeddedServer | None = None  # its log says what the server refused
    redis_server: EmbeddedServer | None = None

    @property
    def url(self) -> str:
        return self.chat_urls[0]

    @property
    def chat_ops_url(self) -> str:
        """The first chat instance's ops port (chat_urls[0] is its public one)."""
        return self.ops_urls[self.ids["chat"][0]]

    def logs(self, num_lines: int = 30) -> str:
        return "\n".join(f"--- {c.name}\n{c.recent_output(num_lines)}" for c in self.children)

    @contextlib.contextmanager
    def relays_paused(self) -> Iterator[None]:
        """Every relay stopped (SIGSTOP) meanwhile: no reply's tokens reach its log, so a reply
        started now runs, and holds what it holds, until this ends."""
        relays = [child for child in self.children if child.name == "relay"]
        for relay in relays:
            os.kill(relay.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for relay in relays:
                os.kill(relay.pid, signal.SIGCONT)


ROLES = ("router", "decode", "relay", "relay", "chat", "chat")

# Two models for `auto` and the quota fallback: two decode workers load the embedded weights under
# a large and a small served name (test_model_routing.py, test_quota_fallback.py).
LARGE, SMALL = "smollm-large", "smollm-small"
TWO_MODEL_ENV = {"TANDEM_KV_CACHE_MIB": "64", "TANDEM_MAX_ANSWER_TOKENS": "4", "TANDEM_LARGE_MODEL": LARGE, "TANDEM_SMALL_MODEL": SMALL}


def two_model_roles(*chats: dict[str, str]) -> list[str | tuple[str, dict[str, str]]]:
    """A router, the large and the small model's decode workers, a relay, and a chat for each of
    `chats` (its own settings)."""
    workers: list[str | tuple[str, dict[str, str]]] = [
        ("decode", {"TANDEM_SERVED_MODEL_NAME": LARGE}),
        ("decode", {"TANDEM_SERVED_MODEL_NAME": SMALL}),
    ]
    return ["router", *workers, "relay", *(("chat", chat) for chat in chats)]


async def wait_listed(stack: ProductStack, models: set[str], headers: dict[str, str]) -> None:
    """Until every chat of `stack` lists exactly `models` (it has heard each one's workers)."""
    for url in stack.chat_urls:

        async def listed(url: str = url) -> bool:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                response = await client.get("/v1/models", headers=headers)
            return response.status_code == 200 and {m["id"] for m in response.json()["data"]} == models

        await wait_until(listed, timeout_s=30)


async def start_product_stack(
    nc,
    nats_url: str,
    redis_url: str,
    workdir: Path,
    roles: Sequence[str | tuple[str, dict[str, str]]] = ROLES,
    **extra_env: str,
) -> ProductStack:
    """`roles`: the processes, started in this order (a lean stack of its own may start fewer);
    a (role, env) pair gives one process settings of its own over the stack's."""
    store_path = workdir / "conversations.db"
    common = {
        "TANDEM_STORE": "sqlite",
        "TANDEM_SQLITE_PATH": str(store_path),
        "TANDEM_KV_CACHE_MIB": "128",
        "TANDEM_API_KEYS": API_KEYS,
        "TANDEM_READER_IDLE_TIMEOUT_S": str(READER_IDLE_TIMEOUT_S),
        "TANDEM_MAX_ANSWER_TOKENS": "48",
        **extra_env,
    }
    stack = ProductStack(chat_urls=[], ids={}, store_path=store_path, nats_url=nats_url, redis_url=redis_url)
    for entry in roles:
        role, own = (entry, {}) if isinstance(entry, str) else entry
        env = service_env(role, nats_url, redis_url, **(common | own))
        child = service_process(role, env)
        child.start()
        stack.children.append(child)
        stack.ids.setdefault(role, []).append(env["TANDEM_INSTANCE_ID"])
        stack.urls[env["TANDEM_INSTANCE_ID"]] = f"http://127.0.0.1:{env['TANDEM_HTTP_PORT']}"
        stack.ops_urls[env["TANDEM_INSTANCE_ID"]] = ops_url(env)
        if role == "chat":
            stack.chat_urls.append(f"http://127.0.0.1:{env['TANDEM_HTTP_PORT']}")
    for role, instance_ids in stack.ids.items():
        for instance_id in instance_ids:
            try:
                await next_heartbeat(nc, role, instance_id, accept=lambda hb: hb.is_ready, timeout_s=180)
            except TimeoutError:
                logs = stack.logs()
                for child in stack.children:
                    child.stop(timeout_s=5)
                raise AssertionError(f"{instance_id} never became ready; the stack's logs:\n{logs}") from None
    # Chat learns the served models from decode heartbeats: one more after everyone is ready.
    await next_heartbeat(nc, "decode", stack.ids["decode"][0], timeout_s=30)
    await next_heartbeat(nc, "decode", stack.ids["decode"][0], timeout_s=30)
    return stack


@contextlib.asynccontextmanager
async def own_product_stack(
    workdir: Path, roles: Sequence[str | tuple[str, dict[str, str]]] = ROLES, **extra_env: str
) -> AsyncIterator[ProductStack]:
    """A product stack on a nats-server and redis-server of its own (for a module that needs other
    settings than the session's stack), stopped with its servers at the end."""
    nats_server, redis_server = start_nats(workdir), start_redis(workdir)
    init_token_stream(nats_server)  # the admin step: services only wait for the stream
    try:
        nc = await nats.connect(nats_server.url)
        try:
            stack = await start_product_stack(nc, nats_server.url, redis_server.url, workdir, roles=roles, **extra_env)
        finally:
            await nc.close()
        stack.nats_server, stack.redis_server = nats_server, redis_server
        try:
            yield stack
        finally:
            for child in stack.children:
                child.stop(timeout_s=10)
    finally:
        redis_server.stop()
        nats_server.stop()


@dataclass(frozen=True)
class Sse:
    id: int
    event: str
    data: dict


async def sse_events(response: httpx.Response) -> AsyncIterator[Sse]:
    """Parses an SSE body as it arrives (comments and keep-alives skipped)."""
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line == "":
            if "data" in fields:
                yield Sse(int(fields.get("id", "0") or 0), fields.get("event", "message"), json.loads(fields["data"]))
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = fields.get(name, "") + value.removeprefix(" ")


def parse_sse(body: str | bytes) -> list[Sse]:
    """Every event of a whole SSE body (comments and keep-alives skipped)."""
    text = body.decode() if isinstance(body, bytes) else body
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if line and not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = fields.get(name, "") + value.removeprefix(" ")
        if "data" in fields:
            events.append(Sse(int(fields.get("id", "0") or 0), fields.get("event", "message"), json.loads(fields["data"])))
    return events


class SseReader:
    """Reads one SSE response in parts: some events now, the rest later."""

    def __init__(self, response: httpx.Response) -> None:
        assert response.status_code == 200, response.status_code
        self._events = sse_events(response)

    async def read(self, stop_after: int | None = None) -> list[Sse]:
        """Events until done/error, or until `stop_after` of them."""
        seen = []
        async for event in self._events:
            seen.append(event)
            if event.event in ("done", "error") or (stop_after is not None and len(seen) >= stop_after):
                break
        return seen


async def read_stream(response: httpx.Response, stop_after: int | None = None) -> list[Sse]:
    """The events of one SSE response, until done/error or after `stop_after` events."""
    if response.status_code != 200:
        raise AssertionError((response.status_code, (await response.aread()).decode()))
    return await SseReader(response).read(stop_after)


def text_of(events: list[Sse]) -> str:
    return "".join(e.data["text"] for e in events if e.event == "delta")
