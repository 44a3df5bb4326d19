"""A deployment's output check that fails must not hold a reply's end back: the final event is
admitted (the reply ends unchecked, and the failure is logged), on a real Redis token log."""

from __future__ import annotations

import uuid

import pytest_asyncio
import redis.asyncio as aioredis

from services.relay.moderation import OutputCheckConfig, OutputModerator
from tandem.tokenlog import ReplyMeta, TokenLogWriter, create_reply
from tandem.v1.common_pb2 import FINISH_REASON_STOP
from tandem.v1.tokens_pb2 import TokenEvent


class BrokenCheck:
    """A deployment's moderation model whose server is down: every call raises."""

    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    async def score(self, texts: list[str]) -> list[float]:
        self.calls += 1
        raise ConnectionError("the moderation server is down")

    def close(self) -> None:
        pass


@pytest_asyncio.fixture
async def redis(redis_server):
    client = aioredis.from_url(redis_server.url, socket_timeout=10)
    yield client
    await client.aclose()


async def test_a_final_event_is_admitted_when_the_check_fails(redis):
    reply_id = uuid.uuid4().hex
    await create_reply(redis, ReplyMeta(reply_id=reply_id, user_id="u", model="m"), track_readers=False)
    writer = TokenLogWriter(redis, ttl_s=60)
    for seq, word in enumerate(("one ", "two ", "three "), start=1):
        await writer.append(TokenEvent(reply_id=reply_id, seq=seq, text=word))
    check = BrokenCheck()
    config = OutputCheckConfig(threshold=0.5, every_tokens=8, window_chars=400, running_ttl_s=600)

    async def publish(subject: str, data: bytes) -> None:
        raise AssertionError(f"nothing is published for a reply the check could not judge ({subject})")

    async def publish_final(event: TokenEvent) -> None:
        raise AssertionError("the reply is not ended as moderated")

    moderator = OutputModerator(redis, check, publish, publish_final, config)  # type: ignore[arg-type]
    final = TokenEvent(reply_id=reply_id, seq=4, text="four.", finish=FINISH_REASON_STOP)
    assert await moderator.admit_final(final)
    assert check.calls == 1  # it was asked, and failed
