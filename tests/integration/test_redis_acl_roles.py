"""Least privilege in Redis (issue 50), on the session's real redis-server, whose users are the
ones `tandem up` makes (tandem.redis_acl): each role's user runs its service's own code path,
and is refused (NoPermissionError, Redis's NOPERM) outside its key patterns and commands."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from followed_log import Collect
from helpers import service_env
from redis.exceptions import AuthenticationError, NoPermissionError

from services.chat.conversations_api import idempotency_key
from services.chat.replies import forget_reply
from services.chat.summaries import job_key
from services.chat.turns import inflight_key
from services.relay.quotas import QuotaSettler
from tandem.config import ApiKey, Tier
from tandem.devstack.servers import EmbeddedServer
from tandem.quota import QuotaConfig, TokenBuckets, reservation_key
from tandem.redis_acl import CHAT, RELAY, can_read_only
from tandem.tokenlog import (
    RUNNING,
    UNPERSISTED,
    LogTail,
    ReplyKeys,
    ReplyMeta,
    TailConfig,
    TokenLogWriter,
    attach,
    create_reply,
    load_reply,
    logged_events,
)
from tandem.v1.common_pb2 import FINISH_REASON_STOP, Usage
from tandem.v1.tokens_pb2 import TokenEvent

QUOTA = QuotaConfig(capacity_free=6000, capacity_plus=60000, capacity_pro=600000, refill_s=3600, reservation_ttl_s=600)
NUM_TOKENS = 3
DEADLINE_S = 10.0


def login(server: EmbeddedServer, role: str) -> aioredis.Redis:
    assert server.secrets is not None
    return aioredis.from_url(server.address, username=role, password=server.secrets.redis_passwords[role], socket_timeout=10)


@pytest_asyncio.fixture
async def chat(redis_server: EmbeddedServer) -> AsyncIterator[aioredis.Redis]:
    client = login(redis_server, CHAT)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def relay(redis_server: EmbeddedServer) -> AsyncIterator[aioredis.Redis]:
    client = login(redis_server, RELAY)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def admin(redis_server: EmbeddedServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server.url, socket_timeout=10)
    yield client
    await client.aclose()


async def server_version(admin: aioredis.Redis) -> str:
    return str((await admin.info("server"))["redis_version"])


def tokens(reply_id: str) -> list[TokenEvent]:
    out = [TokenEvent(reply_id=reply_id, seq=seq, token_id=seq, text=f"t{seq} ") for seq in range(1, NUM_TOKENS + 1)]
    out[-1].finish = FINISH_REASON_STOP
    out[-1].usage.CopyFrom(Usage(input_tokens=10, output_tokens=NUM_TOKENS))
    return out


async def test_the_chat_and_the_relay_serve_a_reply_through_their_own_users(redis_server, chat, relay):
    """The whole Redis life of a reply: the chat charges the quota, creates the reply and follows
    its log on a tail (whose wake stream it writes); the relay appends every event and settles
    the quota; the chat reads the log back."""
    reply_id, user_id = uuid.uuid4().hex, f"u-{uuid.uuid4().hex[:8]}"
    chat_quota = TokenBuckets(chat, QUOTA)
    admission = await chat_quota.reserve(user_id, Tier.FREE, 1000.0, reply_id, num_prompt_tokens=10)
    assert admission.is_admitted
    await create_reply(chat, ReplyMeta(reply_id=reply_id, user_id=user_id, model="m"), track_readers=True)
    await attach(chat, reply_id, "reader-1", lease_s=30)
    tail = LogTail(TailConfig(redis_server.address, num_readers=1, block_ms=2000), chat)
    collect = Collect()
    try:
        await tail.follow(f"other-{uuid.uuid4().hex}", Collect())  # the loop blocks in XREAD: the next join wakes it
        await tail.follow(reply_id, collect)
        writer = TokenLogWriter(relay, 600)
        for event in tokens(reply_id):
            await writer.append(event)
        assert await asyncio.wait_for(collect.ended, DEADLINE_S) is None
    finally:
        await tail.close()
    assert collect.seqs == list(range(1, NUM_TOKENS + 1))
    assert [event.seq for event in await logged_events(chat, reply_id)] == collect.seqs
    meta = await load_reply(chat, reply_id)
    assert meta is not None and meta.last_seq == NUM_TOKENS
    level_before = (await chat_quota.peek(user_id, Tier.FREE)).remaining_units
    await QuotaSettler(relay, TokenBuckets(relay, QUOTA)).settle(tokens(reply_id)[-1])
    assert await chat.exists(reservation_key(reply_id)) == 0, "the relay settled the reservation"
    assert (await chat_quota.peek(user_id, Tier.FREE)).remaining_units > level_before, "what the reply did not use came back"


async def test_the_chat_keeps_its_own_keys_and_forgets_a_reply_that_never_started(chat, admin):
    conversation_id, reply_id = uuid.uuid4().hex, uuid.uuid4().hex
    assert await chat.set(idempotency_key_for(conversation_id), reply_id, nx=True, ex=60)
    assert await chat.getset(inflight_key(conversation_id), reply_id) is None
    assert await chat.set(job_key(conversation_id), "token", nx=True, ex=60)
    await create_reply(chat, ReplyMeta(reply_id=reply_id, user_id="u"), track_readers=False)
    await forget_reply(chat, reply_id)
    assert await admin.exists(*ReplyKeys(reply_id).all()) == 0
    assert not await chat.sismember(RUNNING, reply_id)


def idempotency_key_for(conversation_id: str) -> str:
    return idempotency_key(ApiKey(user_id="u", tier=Tier.FREE), conversation_id, "retry-1")


@pytest.mark.parametrize(
    "key",
    [
        UNPERSISTED,  # the relay's
        "tandem:reply:{r}:pending",  # the relay's out-of-order events
        "other:thing",
        "tandem:nats-something",
    ],
)
async def test_the_chats_user_is_refused_keys_outside_its_patterns(chat, key):
    with pytest.raises(NoPermissionError):
        await chat.exists(key)
    with pytest.raises(NoPermissionError):
        await chat.eval("return redis.call('EXISTS', KEYS[1])", 1, key)  # nor through a script


@pytest.mark.parametrize(
    "key",
    ["tandem:idempotency:u:d", inflight_key("c"), "tandem:tail:x:0:wake", "other:thing"],
)
async def test_the_relays_user_is_refused_the_chats_keys_and_others(relay, key):
    with pytest.raises(NoPermissionError):
        await relay.set(key, "x")


@pytest.mark.parametrize("role", [CHAT, RELAY])
@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "maxmemory"),
        ("KEYS", "*"),
        ("SCAN", "0"),
        ("SCRIPT", "FLUSH"),
        ("CLIENT", "LIST"),
        ("SAVE",),
        ("ACL", "LIST"),
    ],
)
async def test_no_role_runs_admin_commands(redis_server, admin, role, command):
    client = login(redis_server, role)
    try:
        with pytest.raises(NoPermissionError):
            await client.execute_command(*command)
    finally:
        await client.aclose()
    assert await admin.ping(), "the server is still up"


async def test_the_chat_cannot_run_the_relays_info(chat, relay):
    with pytest.raises(NoPermissionError):
        await chat.info("memory")
    assert "maxmemory_policy" in await relay.info("memory")


async def test_the_chats_user_cannot_write_the_token_log(admin, chat, relay):
    if not can_read_only(await server_version(admin)):
        pytest.skip("Redis 6 has no read-only key patterns: the chat's log pattern is read-write there (docs/security.md)")
    reply_id = uuid.uuid4().hex
    await TokenLogWriter(relay, 600).append(tokens(reply_id)[0])
    log_key = ReplyKeys(reply_id).log
    with pytest.raises(NoPermissionError):
        await chat.xadd(log_key, {"e": "forged"})
    with pytest.raises(NoPermissionError):
        await TokenLogWriter(chat, 600).append(tokens(reply_id)[1])  # the relay's own append script
    with pytest.raises(NoPermissionError):
        await chat.delete(log_key)
    assert [event.seq for event in await logged_events(chat, reply_id)] == [1], "what the relay wrote, and only that"


async def test_the_router_has_no_redis_user(redis_server):
    assert redis_server.secrets is not None
    assert "router" not in redis_server.secrets.redis_passwords
    assert "TANDEM_REDIS_PASSWORD" not in redis_server.secrets.service_env("router", "router-0")
    client = aioredis.from_url(redis_server.address, username="router", password=redis_server.secrets.redis_password)
    try:
        with pytest.raises(AuthenticationError):
            await client.ping()
    finally:
        await client.aclose()


async def test_the_admin_keeps_every_right_and_the_roles_are_its_users(admin):
    assert await admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert sorted(await admin.acl_users()) == sorted(["default", CHAT, RELAY])


def test_service_processes_of_the_tests_log_in_as_their_roles_redis_users(nats_server, redis_server):
    """So every integration test that starts a chat or relay process runs it under its ACL user."""
    for role in (CHAT, RELAY):
        env = service_env(role, nats_server.url, redis_server.url)
        assert (env["TANDEM_REDIS_USERNAME"], env["TANDEM_REDIS_PASSWORD"]) == (role, redis_server.secrets.redis_passwords[role])
    assert service_env("router", nats_server.url, redis_server.url)["TANDEM_REDIS_USERNAME"] == ""
