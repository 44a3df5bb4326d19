"""A chat turn: check the message, build the prompt from the conversation, and start the reply
(services.chat.replies.ReplyStarter: the door, the quota, then the turn's stores, then the
router), storing the user turn and a running assistant turn once its quota is reserved (a
refusal stores nothing). Regenerate reuses all but the first store. Every reply carries its
quota fallback (the same prompt to the small model, services.chat.model_routing), which starts
instead when the user's quota cannot afford the decided model; the user turn keeps the decided
model, so the conversation goes back to it once the quota refills."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, replace

from redis.asyncio import Redis

from services.chat import metrics
from services.chat.config import ChatConfig
from services.chat.context import PromptTooLong, Turn, active_history, build_context, parent_seqs, stored_parent_seq
from services.chat.door import Door
from services.chat.errors import ChatError, InvalidRequest, Moderated
from services.chat.model_routing import ModelRouter, Route, conversation_model, turn_model
from services.chat.models_view import ModelsView, ServedModel
from services.chat.moderation import MODERATED_MESSAGE, InputCheck, start_input_check
from services.chat.prompt import LoadedTokenizer, PromptCounter, encode_prompt
from services.chat.prompt_limits import check_message_chars, prompt_too_long
from services.chat.replies import ReplyRequest, ReplyStarter, cancel_reply, new_reply_id
from services.chat.summaries import Summaries, schedule_summary
from services.chat.summary_prompt import summary_of_branch
from tandem import model_ids
from tandem.bus import Bus
from tandem.bus.events import ReplyStatus
from tandem.config import ApiKey
from tandem.store import Conversation, ConversationStore, Message, NewMessage, Role
from tandem.tokenlog import as_text, load_reply
from tandem.v1.common_pb2 import SamplingParams

log = logging.getLogger(__name__)
TITLE_CHARS = 60


def inflight_key(conversation_id: str) -> str:
    return f"tandem:conversation:{{{conversation_id}}}:inflight"


@dataclass(frozen=True)
class SamplingChoice:
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int | None = None
    max_tokens: int | None = None  # None: the tier's answer length (ChatConfig.answer_length), which also caps it

    def params(self, max_tokens: int) -> SamplingParams:
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=max_tokens)
        if self.seed is not None:
            params.seed = self.seed
        return params


@dataclass(frozen=True)
class StartedReply:
    reply_id: str
    model: str
    num_dropped_turns: int
    route: Route | None = None  # how its model was chosen


@dataclass(frozen=True)
class Turns:
    """What sending a message to a conversation, or regenerating an answer, uses."""

    config: ChatConfig
    store: ConversationStore
    redis: Redis  # the conversation's reply in flight
    bus: Bus  # to cancel the reply a new one supersedes
    models: ModelsView
    door: Door
    tokenizer: LoadedTokenizer
    router: ModelRouter
    starter: ReplyStarter
    input_check: InputCheck | None = None
    summaries: Summaries | None = None

    async def resolve_model(self, user: ApiKey, requested: str, text: str, on_model: str = "") -> Route:
        """The model for `text` (services.chat.model_routing); `on_model`: the one the conversation is on."""
        counter = PromptCounter(self.tokenizer.get())
        return await self.router.route(user, requested, text, counter.count, on_model)

    def check_content(self, content: str) -> None:
        if not content.strip():
            raise InvalidRequest("the message is empty", code="empty_message", param="content")
        check_message_chars(content, self.config.max_message_chars, "content")

    async def send_message(
        self,
        user: ApiKey,
        conversation: Conversation,
        content: str,
        requested_model: str,
        reply_id: str,
        sampling: SamplingChoice,
        user_message_id: str = "",
        after_seq: int | None = None,
    ) -> StartedReply:
        """`user_message_id`: the user turn's id; a retry that passes the same one (an idempotency
        key's) finds the turn already stored instead of storing it twice. `after_seq`: the message the
        new turn follows (0: it starts a new branch at the root, an edited first message); None: the
        newest message."""
        self.check_content(content)
        self.door.check_all(user.tier, self.models.models)  # before any work for a message that cannot start
        checking = start_input_check(self.input_check, content)  # in its process, while the prompt is built
        messages = await self.store.list_messages(conversation.id)
        route = await self.resolve_model(user, requested_model, content, await self._conversation_model(messages))
        model = route.model
        counter = PromptCounter(self.tokenizer.get())
        new_turn = Turn("user", content, await asyncio.to_thread(counter.count, content))
        conversation = summary_of_branch(conversation, messages, after_seq)  # another branch's summary stands for nothing here
        history = active_history(messages, conversation.summary_upto_seq, after_seq)
        # Tokenizing a long prompt is slow enough to stall every stream: off the event loop.
        prompt = await asyncio.to_thread(self._prompt, user, conversation, history, new_turn, model, counter)
        user_turn = NewMessage(
            id=user_message_id or uuid.uuid4().hex,
            conversation_id=conversation.id,
            role=Role.USER,
            content=content,
            tokens=new_turn.tokens,
            model=model.name,
            parent_seq=0 if after_seq is None else stored_parent_seq(after_seq),
        )
        if await checking.is_refused(user.tier.value, model.name):  # stored to show, never sent to a model, nothing reserved
            await self.store.append_message(user.user_id, replace(user_turn, status=ReplyStatus.MODERATED))
            raise Moderated(MODERATED_MESSAGE)
        reply = self._reply_request(user, conversation, route, prompt, reply_id, sampling)
        # A conversation's first message names it, in the same write.
        title = None if conversation.title else _title_of(content)
        stored = _StoredTurn(self, conversation, reply, user_turn=user_turn, title=title)
        started = await self._start(reply, stored, prompt.num_dropped)
        metrics.ANSWERS.labels(**metrics.model_labels(started.model)).inc()
        schedule_summary(self.summaries, user, conversation.id, model, history[: prompt.num_dropped], started.reply_id)  # in the background
        return started

    async def regenerate(
        self, user: ApiKey, conversation: Conversation, answer: Message, requested_model: str, sampling: SamplingChoice
    ) -> StartedReply:
        """A new answer to the user turn that `answer` answered; the prompt up to it is cached."""
        messages = await self.store.list_messages(conversation.id)
        user_turn = next((m for m in messages if m.seq == answer.parent_seq and m.role == Role.USER), None)
        if user_turn is None:
            raise InvalidRequest("only an answer to a user message can be regenerated", code="not_an_answer")
        # On the model its user turn was routed to (the answer's may be another pool's, the router's fallback).
        route = await self.resolve_model(user, requested_model, user_turn.content, turn_model(user_turn, messages) or answer.model)
        model = route.model
        conversation = summary_of_branch(conversation, messages, user_turn.seq)
        earlier = active_history(messages, conversation.summary_upto_seq, parent_seqs(messages)[user_turn.seq])  # its own branch
        counter = PromptCounter(self.tokenizer.get())
        new_turn = Turn("user", user_turn.content, user_turn.tokens)
        prompt = await asyncio.to_thread(self._prompt, user, conversation, earlier, new_turn, model, counter)
        reply = self._reply_request(user, conversation, route, prompt, new_reply_id(), sampling)
        started = await self._start(reply, _StoredTurn(self, conversation, reply, parent_seq=user_turn.seq), prompt.num_dropped)
        # The regenerate rate of a model version: its answers replaced over its answers started.
        metrics.REGENERATIONS.labels(**metrics.model_labels(answer.model)).inc()
        metrics.ANSWERS.labels(**metrics.model_labels(started.model)).inc()
        schedule_summary(self.summaries, user, conversation.id, model, earlier[: prompt.num_dropped], started.reply_id)
        return started

    def _prompt(
        self,
        user: ApiKey,
        conversation: Conversation,
        history: list[Message],
        new_turn: Turn,
        model: ServedModel,
        counter: PromptCounter,
    ) -> _Prompt:
        config = self.config
        budget = config.prompt_budget(user.tier, model.window_tokens, counter.generation_prompt_tokens)
        system = Turn("system", config.system_prompt, counter.count(config.system_prompt))
        summary = Turn("system", f"Summary of the conversation so far: {conversation.summary}", 0) if conversation.summary else None
        if summary is not None:
            summary = Turn(summary.role, summary.content, counter.count(summary.content))
        try:
            context = build_context(system, summary, history, new_turn, budget)
        except PromptTooLong as exc:
            raise prompt_too_long(exc) from None
        ids, num_public = encode_prompt(self.tokenizer.get(), context.turns)
        return _Prompt(ids, num_public, context.num_dropped)

    def _reply_request(
        self, user: ApiKey, conversation: Conversation, route: Route, prompt: _Prompt, reply_id: str, sampling: SamplingChoice
    ) -> ReplyRequest:
        wanted = self.config.answer_length(user.tier).max_tokens(sampling.max_tokens)

        def to(route: Route, fallback: ReplyRequest | None) -> ReplyRequest:
            max_tokens = max(1, min(wanted, route.model.window_tokens - len(prompt.ids)))
            return ReplyRequest(
                reply_id=reply_id,
                user=user,
                model=route.model.name,
                prompt_ids=prompt.ids,
                public_prefix_tokens=prompt.num_public,
                sampling=sampling.params(max_tokens),
                conversation_id=conversation.id,
                message_id=reply_id,
                num_dropped_turns=prompt.num_dropped,
                route=route,
                fallback=fallback,
            )

        # One tokenizer serves both models, so the prompt is the small model's too when it fits its window.
        small = self.router.quota_fallback(route)
        fits = small is not None and len(prompt.ids) < small.model.window_tokens
        return to(route, to(small, None) if small is not None and fits else None)

    async def _start(self, reply: ReplyRequest, stored: _StoredTurn, num_dropped: int) -> StartedReply:
        # The router's model: another pool's when the asked one is down or full; the small one when the quota sent it there.
        begun = await self.starter.start_reply(reply, stored)
        return StartedReply(reply.reply_id, begun.model, num_dropped, begun.route)

    async def _conversation_model(self, messages: list[Message]) -> str:
        """conversation_model, with the version of an answer still running: the relay stores an
        answer's model when it ends, but the routers chose its version when it began (its log's
        meta says which), and the next message must stay on it."""
        model = conversation_model(messages)
        newest = messages[-1] if messages else None
        if model_ids.is_versioned(model) or newest is None or newest.role != Role.ASSISTANT or newest.status != ReplyStatus.RUNNING:
            return model
        meta = await load_reply(self.redis, newest.id, with_request=False)
        if meta is not None and model_ids.is_versioned(meta.model) and model_ids.name_of(meta.model) == model:
            return meta.model
        return model

    async def supersede(self, conversation_id: str, reply_id: str) -> None:
        """One reply in flight per conversation: a new one cancels the one before."""
        previous = await self.redis.getset(inflight_key(conversation_id), reply_id)
        if previous is None:
            return
        previous_id = as_text(previous)
        meta = await load_reply(self.redis, previous_id)
        if meta is not None and meta.is_running:
            await cancel_reply(self.bus, previous_id, "superseded")


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    num_public: int
    num_dropped: int


class _StoredTurn:
    """A reply's turns in the store (services.chat.replies.StoredTurn): the user turn, when the
    reply answers a new one, then the running assistant turn the reply fills, which supersedes the
    conversation's reply in flight."""

    def __init__(
        self,
        turns: Turns,
        conversation: Conversation,
        reply: ReplyRequest,
        *,
        user_turn: NewMessage | None = None,
        title: str | None = None,
        parent_seq: int = 0,
    ) -> None:
        self._turns = turns
        self._conversation = conversation
        self._reply = reply
        self._user_turn = user_turn
        self._title = title
        self._parent_seq = parent_seq  # the user turn it answers, when that is stored already

    async def store(self, reply: ReplyRequest) -> None:
        store = self._turns.store
        parent_seq = self._parent_seq
        if self._user_turn is not None:
            parent_seq = (await store.append_message(reply.user.user_id, self._user_turn, title=self._title)).seq
        await store.append_message(
            reply.user.user_id,
            NewMessage(
                id=reply.reply_id,
                conversation_id=self._conversation.id,
                role=Role.ASSISTANT,
                content="",
                tokens=0,
                model=reply.model,
                status=ReplyStatus.RUNNING,
                parent_seq=parent_seq,
            ),
        )
        await self._turns.supersede(self._conversation.id, reply.reply_id)

    async def refuse(self, error: ChatError) -> None:
        """Refused, or no router answered: it never runs."""
        conversation_id, reply_id = self._conversation.id, self._reply.reply_id
        await self._turns.store.finish_message(conversation_id, reply_id, content="", status=ReplyStatus.FAILED, tokens=0)
        await self._turns.redis.delete(inflight_key(conversation_id))
        log.info("reply %s refused: %s: %s", reply_id, error.code, error.message)


def _title_of(content: str) -> str:
    line = " ".join(content.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"
