"""A chat turn: check the message, build the prompt from the conversation, reserve the reply's
quota (a refusal stores nothing), store the user turn and a running assistant turn, and start the
reply. Regenerate reuses all but the first store."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, replace

from services.chat.context import Budget, PromptTooLong, Turn, active_history, build_context, parent_seqs, stored_parent_seq
from services.chat.errors import ChatError, InvalidRequest, Moderated, TooLarge
from services.chat.model_routing import Route, conversation_model, route_model
from services.chat.models_view import ServedModel
from services.chat.moderation import MODERATED_MESSAGE, start_input_check
from services.chat.prompt import PromptCounter, encode_prompt
from services.chat.replies import ReplyRequest, begin_reply, cancel_reply, new_reply_id, reserve_quota
from services.chat.state import ChatState
from services.chat.summaries import schedule_summary
from services.chat.summary_prompt import summary_of_branch
from tandem.bus.events import ReplyStatus
from tandem.config import ApiKey
from tandem.store import Conversation, Message, NewMessage, Role
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
    max_tokens: int | None = None  # None: the configured answer budget

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


async def resolve_model(state: ChatState, user: ApiKey, requested: str, text: str, on_model: str = "") -> Route:
    """The model for `text` (services.chat.model_routing); `on_model`: the one the conversation is on."""
    counter = PromptCounter(state.require_tokenizer())
    return await route_model(state, user, requested, text, counter.count, on_model)


def check_content(state: ChatState, content: str) -> None:
    if not content.strip():
        raise InvalidRequest("the message is empty", code="empty_message", param="content")
    if len(content) > state.config.max_message_chars:
        message = f"the message has {len(content)} characters; at most {state.config.max_message_chars} are accepted"
        raise TooLarge(message, code="message_too_long", param="content")


async def send_message(
    state: ChatState,
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
    check_content(state, content)
    state.door.check_all(user.tier, state.models.models)  # before any work for a message that cannot start
    checking = start_input_check(state.input_check, content)  # in its process, while the prompt is built
    messages = await state.store.list_messages(conversation.id)
    route = await resolve_model(state, user, requested_model, content, conversation_model(messages))
    model = route.model
    state.door.check(model.name, user.tier)  # before anything is stored, tokenized or reserved
    counter = PromptCounter(state.require_tokenizer())
    new_turn = Turn("user", content, await asyncio.to_thread(counter.count, content))
    conversation = summary_of_branch(conversation, messages, after_seq)  # another branch's summary stands for nothing here
    history = active_history(messages, conversation.summary_upto_seq, after_seq)
    # Tokenizing a long prompt takes milliseconds: off the event loop that serves every stream.
    prompt = await asyncio.to_thread(_prompt, state, user, conversation, history, new_turn, model, counter)
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
        await state.store.append_message(user.user_id, replace(user_turn, status=ReplyStatus.MODERATED))
        raise Moderated(MODERATED_MESSAGE)
    reply = _reply_request(state, user, conversation, route, prompt, reply_id, sampling)
    async with reserve_quota(state, reply):  # a turn the quota refuses stores nothing
        # A conversation's first message names it, in the same write.
        user_message = await state.store.append_message(user.user_id, user_turn, title=None if conversation.title else _title_of(content))
        started = await _start(state, conversation, user_message.seq, reply, prompt.num_dropped)
    schedule_summary(state, user, conversation.id, model, history[: prompt.num_dropped], started.reply_id)  # in the background
    return replace(started, route=route.answered_by(started.model))


async def regenerate(
    state: ChatState, user: ApiKey, conversation: Conversation, answer: Message, requested_model: str, sampling: SamplingChoice
) -> StartedReply:
    """A new answer to the user turn that `answer` answered; the prompt up to it is cached."""
    messages = await state.store.list_messages(conversation.id)
    user_turn = next((m for m in messages if m.seq == answer.parent_seq and m.role == Role.USER), None)
    if user_turn is None:
        raise InvalidRequest("only an answer to a user message can be regenerated", code="not_an_answer")
    # On the model its user turn was routed to (the answer's may be another pool's, the router's fallback).
    route = await resolve_model(state, user, requested_model, user_turn.content, user_turn.model or answer.model)
    model = route.model
    conversation = summary_of_branch(conversation, messages, user_turn.seq)
    earlier = active_history(messages, conversation.summary_upto_seq, parent_seqs(messages)[user_turn.seq])  # its own branch
    counter = PromptCounter(state.require_tokenizer())
    new_turn = Turn("user", user_turn.content, user_turn.tokens)
    prompt = await asyncio.to_thread(_prompt, state, user, conversation, earlier, new_turn, model, counter)
    reply = _reply_request(state, user, conversation, route, prompt, new_reply_id(), sampling)
    async with reserve_quota(state, reply):
        started = await _start(state, conversation, user_turn.seq, reply, prompt.num_dropped)
    schedule_summary(state, user, conversation.id, model, earlier[: prompt.num_dropped], started.reply_id)
    return replace(started, route=route.answered_by(started.model))


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    num_public: int
    num_dropped: int


def _prompt(
    state: ChatState,
    user: ApiKey,
    conversation: Conversation,
    history: list[Message],
    new_turn: Turn,
    model: ServedModel,
    counter: PromptCounter,
) -> _Prompt:
    config = state.config
    budget = Budget(
        window_tokens=model.window_tokens - counter.generation_prompt_tokens,
        tier_prompt_tokens=config.prompt_budget_for(user.tier),
        answer_tokens=min(config.max_answer_tokens, model.window_tokens // 2),
    )
    system = Turn("system", config.system_prompt, counter.count(config.system_prompt))
    summary = Turn("system", f"Summary of the conversation so far: {conversation.summary}", 0) if conversation.summary else None
    if summary is not None:
        summary = Turn(summary.role, summary.content, counter.count(summary.content))
    try:
        context = build_context(system, summary, history, new_turn, budget)
    except PromptTooLong as exc:
        raise TooLarge(str(exc), code="prompt_too_long") from None
    ids, num_public = encode_prompt(state.require_tokenizer(), context.turns)
    return _Prompt(ids, num_public, context.num_dropped)


def _reply_request(
    state: ChatState, user: ApiKey, conversation: Conversation, route: Route, prompt: _Prompt, reply_id: str, sampling: SamplingChoice
) -> ReplyRequest:
    model = route.model
    wanted = sampling.max_tokens or state.config.max_answer_tokens
    max_tokens = max(1, min(wanted, model.window_tokens - len(prompt.ids)))
    return ReplyRequest(
        reply_id=reply_id,
        user=user,
        model=model.name,
        prompt_ids=prompt.ids,
        public_prefix_tokens=prompt.num_public,
        sampling=sampling.params(max_tokens),
        conversation_id=conversation.id,
        message_id=reply_id,
        num_dropped_turns=prompt.num_dropped,
        route=route,
    )


async def _start(state: ChatState, conversation: Conversation, parent_seq: int, reply: ReplyRequest, num_dropped: int) -> StartedReply:
    """Stores the running assistant turn and starts its reply (its quota is reserved already)."""
    await state.store.append_message(
        reply.user.user_id,
        NewMessage(
            id=reply.reply_id,
            conversation_id=conversation.id,
            role=Role.ASSISTANT,
            content="",
            tokens=0,
            model=reply.model,
            status=ReplyStatus.RUNNING,
            parent_seq=parent_seq,
        ),
    )
    await _supersede(state, conversation.id, reply.reply_id)
    try:
        model = await begin_reply(state, reply)  # the router's: another pool's when the asked one is down or full
    except ChatError as exc:  # refused, or no router answered: it never runs
        await state.store.finish_message(conversation.id, reply.reply_id, content="", status=ReplyStatus.FAILED, tokens=0)
        await state.redis.delete(inflight_key(conversation.id))
        log.info("reply %s refused: %s: %s", reply.reply_id, exc.code, exc.message)
        raise
    return StartedReply(reply.reply_id, model, num_dropped)


async def _supersede(state: ChatState, conversation_id: str, reply_id: str) -> None:
    """One reply in flight per conversation: a new one cancels the one before."""
    previous = await state.redis.getset(inflight_key(conversation_id), reply_id)
    if previous is None:
        return
    previous_id = as_text(previous)
    meta = await load_reply(state.redis, previous_id)
    if meta is not None and meta.is_running:
        await cancel_reply(state, previous_id, "superseded")


def _title_of(content: str) -> str:
    line = " ".join(content.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"
