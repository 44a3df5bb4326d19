"""The bus and Redis behind the product stack take only logged-in clients, and an instance's login
buys only its role's subjects, bound to its instance: chat's (the service facing the internet) cannot put tokens into a
reply, pose as a worker or send KV events, and what the server refuses never reaches the relay."""

from __future__ import annotations

import asyncio
import re
import uuid

import nats
import pytest
import redis.asyncio as aioredis
from helpers import wait_until
from redis.exceptions import AuthenticationError

from tandem.bus import encode, subjects
from tandem.devstack.bus_users import join_local_bus
from tandem.devstack.secrets import login_of
from tandem.tokenlog.keys import ReplyKeys
from tandem.v1.common_pb2 import FINISH_REASON_STOP
from tandem.v1.tokens_pb2 import TokenEvent

REFUSED_WITHIN_S = 10.0


def _final_event(reply_id: str) -> TokenEvent:
    return TokenEvent(reply_id=reply_id, seq=1, token_id=1, text="forged", finish=FINISH_REASON_STOP)


def _violations(product_stack) -> list[str]:
    assert product_stack.nats_server is not None
    return [line for line in product_stack.nats_server.child.recent_output(100_000).splitlines() if "Violation" in line]


async def test_a_bus_client_without_a_login_or_with_a_wrong_password_is_refused(product_stack):
    address = login_of(product_stack.nats_url)[0]
    for login in ({}, {"user": "chat", "password": "not-its-password"}):
        with pytest.raises(nats.errors.Error) as refused:
            await nats.connect(address, **login, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)
        assert not isinstance(refused.value, nats.errors.NoServersError), "the server answered, and refused"
        assert "Authorization Violation" in str(refused.value)
    operator = await nats.connect(
        product_stack.nats_url, allow_reconnect=False, max_reconnect_attempts=0
    )  # the same server lets a login in
    assert operator.is_connected
    await operator.close()


async def test_chat_cannot_publish_tokens_heartbeats_or_kv_events_and_the_relay_never_logs_a_forged_token(product_stack):
    assert not _violations(product_stack), "the stack's own traffic stayed within each role's rights"
    env = join_local_bus("chat", f"chat-intruder-{uuid.uuid4().hex[:8]}", product_stack.nats_url)  # a chat instance's own login
    refusals: asyncio.Queue[Exception] = asyncio.Queue()

    async def on_error(exc: Exception) -> None:
        refusals.put_nowait(exc)

    address = login_of(product_stack.nats_url)[0]
    chat = await nats.connect(address, user=env["TANDEM_NATS_USER"], password=env["TANDEM_NATS_PASSWORD"], error_cb=on_error)
    operator = await nats.connect(product_stack.nats_url)
    redis = aioredis.from_url(product_stack.redis_url)
    forged_id, control_id = f"forged-{uuid.uuid4().hex}", f"control-{uuid.uuid4().hex}"
    delivered: list[bytes] = []

    async def on_forged(msg: nats.aio.msg.Msg) -> None:
        delivered.append(msg.data)

    try:
        await operator.subscribe(subjects.tokens(forged_id), cb=on_forged)
        await operator.flush()
        forbidden = [subjects.tokens(forged_id), subjects.heartbeat("decode", forged_id), subjects.kv_events(forged_id)]
        for subject in forbidden:
            await chat.publish(subject, encode(_final_event(forged_id)))
        await chat.flush()
        for subject in forbidden:
            refusal = await asyncio.wait_for(refusals.get(), REFUSED_WITHIN_S)
            assert re.search(rf'permissions violation for publish to "{re.escape(subject)}"', str(refusal), re.IGNORECASE), refusal
        assert chat.is_connected, "a refused publish is reported, the connection stays"

        # The same event from a login that may publish tokens is logged: the relay is listening.
        await operator.publish(subjects.tokens(control_id), encode(_final_event(control_id)))
        await wait_until(lambda: redis.exists(ReplyKeys(control_id).log), timeout_s=30)
        assert not await redis.exists(ReplyKeys(forged_id).log), "the relay logged nothing of the forged reply"
        assert delivered == [], "no subscriber ever saw the forged event"
        assert {line.split('Subject "')[1].split('"')[0] for line in _violations(product_stack)} == set(forbidden)
    finally:
        await chat.close()
        await operator.close()
        await redis.aclose()


async def test_redis_without_the_password_or_with_a_wrong_one_is_refused(product_stack):
    plain = login_of(product_stack.redis_url)[0]
    for url in (plain, plain.replace("redis://", "redis://:wrong-password@")):
        client = aioredis.from_url(url)
        with pytest.raises(AuthenticationError):
            await client.get(ReplyKeys("any").meta)
        await client.aclose()
    client = aioredis.from_url(product_stack.redis_url)  # the same server with the password
    assert await client.ping()
    await client.aclose()
