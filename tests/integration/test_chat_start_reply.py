"""One quota reservation per message, on a real redis-server and nats-server: a chat turn
(services.chat.turns) and an OpenAI chat completion (services.chat.openai_replies) each start
their reply through the one ReplyStarter.start_reply, and Redis runs the reservation's script
once for it (counted with MONITOR: a reservation is an EVALSHA naming the user's bucket and the
reply's reservation key). A turn that reserved again inside its own reservation costs a second."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from services.chat.config import ChatConfig
from services.chat.door import Door
from services.chat.fanout import open_fanout
from services.chat.latency import ReplyClock
from services.chat.model_routing import ModelRouter, RoutingConfig
from services.chat.models_view import ModelsView
from services.chat.openai_replies import ModelChoice, OpenAIAnswers
from services.chat.openai_schemas import ChatCompletionBody
from services.chat.openai_shape import CHAT
from services.chat.prompt import LoadedTokenizer
from services.chat.replies import ReplyStarter
from services.chat.turns import SamplingChoice, Turns
from tandem.bus import Bus, BusConfig, encode, subjects
from tandem.bus.events import final_event
from tandem.config import ApiKey, Tier
from tandem.models.loader import load_tokenizer
from tandem.quota import QuotaConfig, TokenBuckets, bucket_key, reservation_key
from tandem.store import Conversation
from tandem.store.sqlite import SqliteStore
from tandem.tokenlog import TokenLogWriter
from tandem.v1.common_pb2 import FINISH_REASON_STOP
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat

pytestmark = pytest.mark.real_model  # the embedded model's tokenizer builds the turn's prompt

CONFIG = ChatConfig(
    system_prompt="You are helpful.",
    max_answer_tokens=16,
    prompt_budget_free=512,
    prompt_budget_plus=512,
    max_message_chars=1000,
    idempotency_ttl_s=60,
    generate_timeout_s=5.0,
)
QUOTA = QuotaConfig(capacity_free=6000, capacity_plus=60000, capacity_pro=600000, refill_s=600.0, reservation_ttl_s=120)
MODEL = "m"
MARKER_TIMEOUT_S = 10.0  # only a way out: MONITOR shows the marker right after the commands before it


class RedisCommands:
    """Every command clients send Redis while it is open (MONITOR), in the order Redis ran them;
    commands a Lua script runs are left out. Closing sends a marker and reads up to it, so every
    command sent before is in `commands` (Redis runs one command at a time)."""

    def __init__(self, url: str) -> None:
        self._client = aioredis.from_url(url)
        self._monitor = self._client.monitor()
        self._marker = f"end-of-test-{uuid.uuid4().hex}"
        self.commands: list[str] = []

    async def __aenter__(self) -> RedisCommands:
        await self._monitor.__aenter__()
        self._reading = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        while True:
            info = await self._monitor.next_command()
            if info["client_type"] == "lua":
                continue
            if self._marker in info["command"]:
                return
            self.commands.append(info["command"])

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._client.echo(self._marker)
            await asyncio.wait_for(self._reading, MARKER_TIMEOUT_S)
        finally:
            self._reading.cancel()
            await self._monitor.__aexit__()
            await self._client.aclose()

    def num_reservations(self, user: ApiKey, reply_id: str) -> int:
        """Runs of the reservation script for `reply_id` (its keys: the user's bucket, then the reservation)."""
        keys = f"2 {bucket_key(user.user_id)} {reservation_key(reply_id)}"
        return sum(1 for command in self.commands if command.split(" ", 1)[0].upper() == "EVALSHA" and keys in command)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest_asyncio.fixture
async def bus(nats_server) -> AsyncIterator[Bus]:
    bus = Bus(BusConfig(url=nats_server.url, name="test-chat-start-reply"))
    bus.start()
    await bus.wait_connected()
    yield bus
    await bus.close()


@pytest_asyncio.fixture
async def redis(redis_server) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.from_url(redis_server.url, socket_timeout=10)
    yield redis
    await redis.aclose()


@pytest_asyncio.fixture
async def quotas(redis) -> TokenBuckets:
    quotas = TokenBuckets(redis, QUOTA)
    # Its script is loaded now, so the counted runs are one EVALSHA each (a first run is two: NOSCRIPT, then again).
    await quotas.reserve(f"warm-{uuid.uuid4().hex}", Tier.FREE, 1, uuid.uuid4().hex)
    return quotas


@pytest_asyncio.fixture
async def models() -> ModelsView:
    models = ModelsView()
    heartbeat = WorkerHeartbeat(service=ServiceHeartbeat(instance_id="d1"), model=MODEL, max_model_len=2048, is_engine_ready=True)
    await models.on_heartbeat(SimpleNamespace(data=heartbeat.SerializeToString(), subject="tandem.v1.heartbeat.decode.d1"))
    return models


@pytest_asyncio.fixture
async def router(bus, redis) -> AsyncIterator[list[GenerateRequest]]:
    """Accepts every generate request, as a router would, and logs its reply's final event, as the relay would."""
    requests: list[GenerateRequest] = []

    async def accept(msg) -> None:
        request = GenerateRequest.FromString(msg.data)
        requests.append(request)
        await msg.respond(encode(GenerateReply(reply_id=request.reply_id, model=request.model)))
        await TokenLogWriter(redis, ttl_s=60).append(final_event(request.reply_id, 1, FINISH_REASON_STOP))

    subscription = await bus.client.subscribe(subjects.GENERATE, queue="router", cb=accept)
    await bus.client.flush()
    yield requests
    await subscription.unsubscribe()


def free_user() -> ApiKey:
    return ApiKey(user_id=uuid.uuid4().hex, tier=Tier.FREE)


def starter(redis, bus, quotas, door: Door) -> ReplyStarter:
    return ReplyStarter(redis, bus, door, quotas, CONFIG.generate_timeout_s)


async def test_a_chat_turn_reserves_its_reply_once(redis_server, redis, bus, quotas, models, router, tokenizer, tmp_path):
    store = SqliteStore(tmp_path / "conversations.db")
    await store.start()
    door = Door()
    turns = Turns(
        config=CONFIG,
        store=store,
        redis=redis,
        bus=bus,
        models=models,
        door=door,
        tokenizer=LoadedTokenizer(tokenizer),
        router=ModelRouter(RoutingConfig.of(CONFIG), models),
        starter=starter(redis, bus, quotas, door),
    )
    user = free_user()
    conversation = Conversation(id=uuid.uuid4().hex, user_id=user.user_id, title="", model="", created_at_ms=1, updated_at_ms=1)
    await store.create_conversation(conversation)
    reply_id = uuid.uuid4().hex
    try:
        async with RedisCommands(redis_server.url) as seen:
            started = await turns.send_message(user, conversation, "What is the capital of France?", MODEL, reply_id, SamplingChoice())
    finally:
        await store.close()
    assert started.reply_id == reply_id and [r.reply_id for r in router] == [reply_id]
    assert (await quotas.reservation(reply_id)).units > 0, "the reply's worst case is reserved for the relay to settle"
    assert seen.num_reservations(user, reply_id) == 1, seen.commands


async def test_an_openai_completion_reserves_its_reply_once(redis_server, redis, bus, quotas, models, router):
    fanout = open_fanout(CONFIG, redis_server.url, redis, "test-chat")
    answers = OpenAIAnswers(
        starter(redis, bus, quotas, Door()),
        fanout,
        bus,
        LoadedTokenizer(),
        answer_lengths=CONFIG.answer_lengths(),
        prompt_budget=CONFIG.prompt_budget,
        keepalive_s=CONFIG.keepalive_s,
    )
    user = free_user()
    body = ChatCompletionBody(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}])
    model = models.models()[MODEL]
    try:
        async with RedisCommands(redis_server.url) as seen:
            response = await answers.answer(user, body, ModelChoice(model), [1, 2, 3, 4], CHAT, "messages", ReplyClock("free", MODEL, 0.0))
    finally:
        await fanout.close()
    assert response.status_code == 200
    [request] = router
    assert (await quotas.reservation(request.reply_id)).units > 0
    assert seen.num_reservations(user, request.reply_id) == 1, seen.commands
