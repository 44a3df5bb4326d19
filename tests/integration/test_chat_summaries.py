"""Summary jobs in the chat process, on a real nats-server, redis-server and SQLite store, with a
stand-in for the router, worker and relay on the bus and the token log (it records each generate
request, then accepts it and logs an answer, refuses it, or stays silent): a job asks on the
background lane, greedy and bounded, for a summary of the summary so far + the dropped turns,
and stores it up to the newest of them; its reply is recorded with no conversation or message (the
relay stores no turn for it); it never moves a summary backwards, even when another one lands
while it runs; one job per conversation holds its key; a refused, unanswered or late job stores
nothing, raises nothing and is counted; a process runs at most its bound of jobs."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from helpers import wait_until
from prometheus_client import REGISTRY

from services.chat.attach_reads import AttachReads
from services.chat.auth import Authenticator
from services.chat.config import ChatConfig
from services.chat.fanout import open_fanout
from services.chat.key_ring import KeyRing
from services.chat.models_view import ModelsView, ServedModel
from services.chat.prompt import LoadedTokenizer
from services.chat.state import ChatState
from services.chat.stream_slots import StreamSlots
from services.chat.summaries import Outcome, Summaries, SummaryConfig, SummaryFailed, SummaryJob, SummaryWriter, job_key, store_if_newer
from services.chat.summary_reply import SummaryAsker
from tandem.bus import Bus, BusConfig, encode, subjects
from tandem.bus.events import error_event, final_event, now_ms
from tandem.config import ApiKey, Tier
from tandem.models.loader import load_tokenizer
from tandem.store import Conversation, Message, NewMessage, Role
from tandem.store.sqlite import SqliteStore
from tandem.tokenlog import ReplyKeys, ReplyMeta, TokenLogWriter, create_reply, load_reply
from tandem.v1.common_pb2 import FINISH_REASON_STOP, LANE_BACKGROUND, Usage
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest, Refusal
from tandem.v1.tokens_pb2 import TokenEvent

pytestmark = pytest.mark.real_model

CONFIG = ChatConfig(
    system_prompt="",
    max_answer_tokens=32,
    prompt_budget_free=432,  # a prompt of 400 tokens: a summary may take a quarter, 100
    prompt_budget_plus=4000,
    max_message_chars=1000,
    idempotency_ttl_s=60,
)
USER = ApiKey(user_id="ada", tier=Tier.FREE)
MODEL = ServedModel("m", 2048, 0)
SUMMARY = "Ada lives in Paris and asked about the capitals of eight countries."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest_asyncio.fixture
async def state(redis_server, nats_server, tmp_path, tokenizer) -> AsyncIterator[ChatState]:
    bus = Bus(BusConfig(url=nats_server.url, name="test-chat"))
    bus.start()
    await bus.wait_connected()
    store = SqliteStore(tmp_path / "conversations.db")
    await store.start()
    redis = aioredis.from_url(redis_server.url, socket_timeout=10)
    fanout = open_fanout(CONFIG, redis_server.url, redis, "test-chat")
    state = ChatState(
        config=CONFIG,
        auth=Authenticator(KeyRing.load({}, None)),
        store=store,
        redis=redis,
        fanout=fanout,
        attach_reads=AttachReads.of(redis, fanout, CONFIG),
        stream_slots=StreamSlots(CONFIG.max_streams, CONFIG.stream_limits()),
        bus=bus,
        models=ModelsView(),
        tokenizer=LoadedTokenizer(tokenizer),
    )
    yield state
    await state.fanout.close()
    await state.redis.aclose()
    await store.close()
    await bus.close()


class RouterStandIn:
    """Answers generate requests on the bus as the router would, and logs the answer's tokens as a
    worker and the relay would. Its answer to the n-th request is `modes[n]` (the last one for any
    after): "answer"; "refuse" (the ladder's refusal, retry in 10 s); "refuse_briefly" (retry at
    once); "worker_busy" (accepted, then the worker's queue_full refusal ends it as an overloaded
    error); "silent" (accepted, nothing logged)."""

    def __init__(self, state: ChatState, *modes: str, before_answer=None) -> None:
        self.state, self.modes, self.before_answer = state, modes or ("answer",), before_answer
        self.requests: list[GenerateRequest] = []

    async def __aenter__(self) -> RouterStandIn:
        self.subscription = await self.state.bus.client.subscribe(subjects.GENERATE, queue="router", cb=self.on_request)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.subscription.unsubscribe()

    async def on_request(self, msg) -> None:
        request = GenerateRequest.FromString(msg.data)
        mode = self.modes[min(len(self.requests), len(self.modes) - 1)]
        self.requests.append(request)
        if mode in ("refuse", "refuse_briefly"):
            retry_after_s = 10 if mode == "refuse" else 0
            refusal = Refusal(
                reason="overloaded", message="background work is paused while the service is busy", retry_after_s=retry_after_s
            )
            await msg.respond(encode(GenerateReply(refused=refusal)))
            return
        await msg.respond(encode(GenerateReply(reply_id=request.reply_id, model=request.model)))
        writer = TokenLogWriter(self.state.redis, ttl_s=60)
        if mode == "worker_busy":
            message = "this worker is busy; background work runs only on idle capacity"
            await writer.append(error_event(request.reply_id, 1, "overloaded", message, retry_after_s=10))
            return
        if mode == "silent":
            return
        if self.before_answer is not None:
            await self.before_answer()
        words = SUMMARY.split(" ")
        for seq, word in enumerate(words, start=1):
            await writer.append(TokenEvent(reply_id=request.reply_id, seq=seq, text=word if seq == 1 else f" {word}"))
        usage = Usage(input_tokens=len(request.prompt_token_ids), output_tokens=len(words))
        await writer.append(final_event(request.reply_id, len(words) + 1, FINISH_REASON_STOP, usage=usage))


async def long_conversation(state: ChatState, num_turns: int = 8) -> tuple[Conversation, list[Message]]:
    conversation = Conversation(
        id=uuid.uuid4().hex, user_id=USER.user_id, title="t", model="m", created_at_ms=now_ms(), updated_at_ms=now_ms()
    )
    await state.store.create_conversation(conversation)
    messages = []
    for number in range(1, num_turns + 1):
        role = Role.USER if number % 2 else Role.ASSISTANT
        content = (
            f"The capital of country {number} is city {number}." if role == Role.ASSISTANT else f"Ada asks about country {number + 1}."
        )
        message = NewMessage(
            uuid.uuid4().hex, conversation.id, role, content, 12, model="m", parent_seq=messages[-1].seq if messages else 0
        )
        messages.append(await state.store.append_message(USER.user_id, message))
    return conversation, messages


def counted(outcome: Outcome) -> float:
    return REGISTRY.get_sample_value("tandem_chat_summaries_total", {"outcome": outcome.value}) or 0.0


async def stored_conversation(state: ChatState, conversation: Conversation) -> Conversation:
    found = await state.store.get_conversation(USER.user_id, conversation.id)
    assert found is not None
    return found


def writer_of(state: ChatState, config: SummaryConfig) -> SummaryWriter:
    asker = SummaryAsker(state.redis, state.bus, state.fanout, state.config.generate_timeout_s)
    return SummaryWriter(config, state.config, state.redis, state.store, state.tokenizer, asker)


async def write_summary(state: ChatState, job: SummaryJob, config: SummaryConfig) -> Outcome:
    return await writer_of(state, config).write(job)


def summaries(state: ChatState, **changes) -> Summaries:
    config = SummaryConfig(is_enabled=True, max_tokens=200, **changes)
    return Summaries(config, writer_of(state, config).write)


async def test_a_summary_of_the_dropped_turns_is_asked_on_the_background_lane_and_stored_up_to_the_newest_of_them(state, tokenizer):
    conversation, messages = await long_conversation(state)
    jobs, written_before = summaries(state), counted(Outcome.WRITTEN)
    async with RouterStandIn(state) as router:
        jobs.schedule(job_of(conversation, messages[:4]))
        await jobs.wait()
    stored = await stored_conversation(state, conversation)
    assert (stored.summary, stored.summary_upto_seq) == (SUMMARY, messages[3].seq)
    assert counted(Outcome.WRITTEN) == written_before + 1
    [request] = router.requests
    assert request.lane == LANE_BACKGROUND
    assert (request.model, request.conversation_id, request.user_id) == ("m", conversation.id, USER.user_id)
    assert request.sampling.temperature == 0.0, "greedy"
    assert request.sampling.max_tokens == 100, "bounded by a quarter of the free tier's prompt (400 tokens), under the setting's 200"
    prompt = tokenizer.decode(request.prompt_token_ids)
    positions = [prompt.index(m.content) for m in messages[:4]]
    assert positions == sorted(positions), "the dropped turns, oldest first"
    assert messages[4].content not in prompt, "the turns still in the prompt are not summarised"
    meta = await load_reply(state.redis, request.reply_id)
    assert meta is not None and (meta.conversation_id, meta.message_id) == ("", ""), "the relay stores no turn for it"
    assert len(await state.store.list_messages(conversation.id)) == len(messages), "the summary is no message of the conversation"
    assert not await state.redis.exists(job_key(conversation.id)), "the conversation's key is released"


async def test_the_next_summary_extends_the_stored_one_with_the_turns_it_does_not_cover(state, tokenizer):
    conversation, messages = await long_conversation(state)
    await state.store.update_conversation(USER.user_id, conversation.id, summary="Ada lives in Paris.", summary_upto_seq=messages[1].seq)
    async with RouterStandIn(state) as router:
        outcome = await write_summary(state, job_of(conversation, messages[:6]), summaries(state).config)
    assert outcome == Outcome.WRITTEN
    prompt = tokenizer.decode(router.requests[0].prompt_token_ids)
    assert "Ada lives in Paris." in prompt, "the summary so far"
    assert messages[0].content not in prompt and messages[1].content not in prompt, "what it covers is not sent again"
    assert prompt.index(messages[2].content) < prompt.index(messages[5].content)
    assert (await stored_conversation(state, conversation)).summary_upto_seq == messages[5].seq


def job_of(conversation: Conversation, dropped: list[Message], after_reply_id: str = "") -> SummaryJob:
    return SummaryJob(USER, conversation.id, MODEL, tuple(dropped), after_reply_id)


async def test_a_job_never_moves_the_summary_backwards(state):
    conversation, messages = await long_conversation(state)
    await state.store.update_conversation(USER.user_id, conversation.id, summary="newer", summary_upto_seq=messages[5].seq)
    async with RouterStandIn(state) as router:
        outcome = await write_summary(state, job_of(conversation, messages[:4]), summaries(state).config)
    assert outcome == Outcome.SKIPPED and router.requests == [], "nothing new to cover: the model is not asked"
    assert not await store_if_newer(state.store, USER.user_id, conversation.id, "older", messages[3].seq)
    assert not await store_if_newer(state.store, USER.user_id, conversation.id, "same", messages[5].seq)
    assert (await stored_conversation(state, conversation)).summary == "newer"
    assert await store_if_newer(state.store, USER.user_id, conversation.id, "further", messages[6].seq)
    assert (await stored_conversation(state, conversation)).summary_upto_seq == messages[6].seq


async def test_a_summary_stored_while_a_job_ran_that_covers_more_is_kept(state):
    conversation, messages = await long_conversation(state)

    async def another_lands() -> None:  # as if another instance's job had stored one meanwhile
        await state.store.update_conversation(USER.user_id, conversation.id, summary="wider", summary_upto_seq=messages[6].seq)

    async with RouterStandIn(state, before_answer=another_lands) as router:
        outcome = await write_summary(state, job_of(conversation, messages[:4]), summaries(state).config)
    assert len(router.requests) == 1
    assert outcome == Outcome.SKIPPED
    stored = await stored_conversation(state, conversation)
    assert (stored.summary, stored.summary_upto_seq) == ("wider", messages[6].seq)


async def test_one_job_per_conversation_a_held_key_skips_the_job_and_stays_its_holders(state):
    conversation, messages = await long_conversation(state)
    await state.redis.set(job_key(conversation.id), "another-instance", ex=60)
    async with RouterStandIn(state) as router:
        outcome = await write_summary(state, job_of(conversation, messages[:4]), summaries(state).config)
    assert outcome == Outcome.SKIPPED and router.requests == []
    assert await state.redis.get(job_key(conversation.id)) == b"another-instance"
    assert 0 < await state.redis.ttl(job_key(conversation.id)) <= 60
    assert (await stored_conversation(state, conversation)).summary == ""


async def test_a_refused_summary_stores_nothing_keeps_no_reply_and_is_counted_as_refused(state):
    conversation, messages = await long_conversation(state)
    jobs, refused_before = summaries(state, timeout_s=3), counted(Outcome.REFUSED)  # the refusal's retry time (10 s) is past it
    async with RouterStandIn(state, "refuse") as router:
        with pytest.raises(SummaryFailed) as failure:
            await write_summary(state, job_of(conversation, messages[:4]), jobs.config)
        jobs.schedule(job_of(conversation, messages[:4]))
        await jobs.wait()  # the scheduled one ends without raising
    assert failure.value.outcome == Outcome.REFUSED
    assert counted(Outcome.REFUSED) == refused_before + 1
    assert (await stored_conversation(state, conversation)).summary == ""
    for request in router.requests:
        assert not await state.redis.exists(*ReplyKeys(request.reply_id).all())
    assert not await state.redis.exists(job_key(conversation.id))


async def test_a_job_no_router_answers_fails_without_raising(state):
    conversation, messages = await long_conversation(state)
    jobs, failed_before = summaries(state), counted(Outcome.FAILED)
    jobs.schedule(job_of(conversation, messages[:4]))
    await jobs.wait()
    assert counted(Outcome.FAILED) == failed_before + 1
    assert (await stored_conversation(state, conversation)).summary == ""


async def test_a_summary_past_its_deadline_fails_and_its_reply_is_cancelled(state):
    conversation, messages = await long_conversation(state)
    cancels = await state.bus.client.subscribe(subjects.CANCEL_ALL)
    async with RouterStandIn(state, "silent") as router:
        with pytest.raises(SummaryFailed) as failure:
            await write_summary(state, job_of(conversation, messages[:4]), summaries(state, timeout_s=0.5).config)
    assert failure.value.outcome == Outcome.FAILED
    cancel = await cancels.next_msg(timeout=5)
    assert cancel.subject == subjects.cancel(router.requests[0].reply_id), "the worker stops writing it"
    await cancels.unsubscribe()
    assert (await stored_conversation(state, conversation)).summary == ""


async def test_a_process_runs_at_most_its_bound_of_jobs_and_counts_the_rest_as_skipped(state):
    first, first_messages = await long_conversation(state)
    second, second_messages = await long_conversation(state)
    jobs, skipped_before = summaries(state, max_jobs=1), counted(Outcome.SKIPPED)
    async with RouterStandIn(state):
        jobs.schedule(job_of(first, first_messages[:4]))
        jobs.schedule(job_of(second, second_messages[:4]))
        assert jobs.num_running == 1
        await jobs.wait()
    assert counted(Outcome.SKIPPED) == skipped_before + 1
    assert (await stored_conversation(state, first)).summary == SUMMARY
    assert (await stored_conversation(state, second)).summary == ""


async def test_no_job_when_summaries_are_off_or_nothing_was_dropped(state):
    conversation, messages = await long_conversation(state)
    off_config = SummaryConfig(is_enabled=False, max_tokens=200)
    off = Summaries(off_config, writer_of(state, off_config).write)
    off.schedule(job_of(conversation, messages[:4]))
    on = summaries(state)
    on.schedule(job_of(conversation, []))
    assert off.num_running == on.num_running == 0


async def test_closing_cancels_running_jobs_and_releases_their_keys(state):
    conversation, messages = await long_conversation(state)
    jobs = summaries(state)
    async with RouterStandIn(state, "silent") as router:
        jobs.schedule(job_of(conversation, messages[:4]))
        await wait_until(lambda: asyncio.sleep(0, router.requests), timeout_s=10)  # the job reads its (silent) reply
        await jobs.close()
    assert jobs.num_running == 0
    assert not await state.redis.exists(job_key(conversation.id))


async def test_a_refusal_is_asked_again_after_its_retry_time_within_the_deadline(state):
    conversation, messages = await long_conversation(state)
    async with RouterStandIn(state, "refuse_briefly", "worker_busy", "answer") as router:
        config = SummaryConfig(is_enabled=True, max_tokens=200, timeout_s=30)
        outcome = await write_summary(state, job_of(conversation, messages[:4]), config)
    assert outcome == Outcome.WRITTEN
    assert len(router.requests) == 3, "the ladder's refusal, then the worker's, then the summary"
    assert len({request.reply_id for request in router.requests}) == 3, "each time a new reply"
    assert (await stored_conversation(state, conversation)).summary == SUMMARY


async def test_a_worker_that_refuses_the_background_lane_counts_as_a_refusal(state):
    conversation, messages = await long_conversation(state)
    async with RouterStandIn(state, "worker_busy"):
        with pytest.raises(SummaryFailed) as failure:
            await write_summary(state, job_of(conversation, messages[:4]), summaries(state, timeout_s=3).config)
    assert failure.value.outcome == Outcome.REFUSED
    assert (await stored_conversation(state, conversation)).summary == ""


async def test_a_job_asks_only_once_its_turns_answer_has_ended(state):
    conversation, messages = await long_conversation(state)
    turn_reply = uuid.uuid4().hex
    await create_reply(state.redis, ReplyMeta(reply_id=turn_reply, model="m"), track_readers=True)
    async with RouterStandIn(state) as router:
        with pytest.raises(SummaryFailed) as failure:
            await write_summary(state, job_of(conversation, messages[:4], turn_reply), summaries(state, timeout_s=2).config)
        assert failure.value.outcome == Outcome.FAILED and router.requests == [], "never asked beside a running answer"
        await TokenLogWriter(state.redis, ttl_s=60).append(final_event(turn_reply, 1, FINISH_REASON_STOP))
        outcome = await write_summary(state, job_of(conversation, messages[:4], turn_reply), summaries(state, timeout_s=10).config)
    assert outcome == Outcome.WRITTEN and len(router.requests) == 1


async def test_a_summary_of_another_branch_is_replaced_by_the_branch_written_on_last(state):
    conversation, messages = await long_conversation(state)
    edit = NewMessage(uuid.uuid4().hex, conversation.id, Role.USER, "An edit of the third message.", 8, parent_seq=messages[1].seq)
    edited = await state.store.append_message(USER.user_id, edit)
    await state.store.update_conversation(USER.user_id, conversation.id, summary="branch one", summary_upto_seq=messages[5].seq)
    assert not await store_if_newer(state.store, USER.user_id, conversation.id, "less of branch one", messages[3].seq)
    assert await store_if_newer(state.store, USER.user_id, conversation.id, "branch two", edited.seq)
    stored = await stored_conversation(state, conversation)
    assert (stored.summary, stored.summary_upto_seq) == ("branch two", edited.seq)
