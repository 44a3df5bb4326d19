"""What the OpenAI endpoints share once they have a prompt's token ids: check it fits the model
and the caller's tier's prompt budget, start the reply, and answer it whole or as SSE chunks read from its token log, in the endpoint's
`ReplyShape` (openai_shape.py). Replies are
not stored as conversations; a client that goes away cannot resume, so its reply is cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from fastapi.responses import JSONResponse

from services.chat.config import AnswerLength
from services.chat.context import Budget
from services.chat.errors import InvalidRequest, NotFound, Unavailable
from services.chat.fanout import FanoutHub
from services.chat.latency import ReplyClock
from services.chat.model_routing import AUTO, DecidedBy, ModelRouter, Route, UnknownModel
from services.chat.models_view import ServedModel
from services.chat.openai_logprobs import ReplyLogprobs
from services.chat.openai_schemas import GenerationBody, openai_finish_reason
from services.chat.openai_shape import ReplyShape
from services.chat.openai_tools import ToolCallStream, parse_tool_calls
from services.chat.prompt import LoadedTokenizer, PromptCounter
from services.chat.prompt_limits import check_prompt_tokens
from services.chat.replies import ReplyRequest, ReplyStarter, cancel_reply, new_reply_id
from services.chat.sse import OPENAI_SEPARATOR, StreamResponse, sse_response
from services.chat.streaming import log_events
from tandem import __version__
from tandem.bus import Bus
from tandem.bus.events import is_final
from tandem.config import ApiKey, Tier
from tandem.models.tokenizer import Tokenizer
from tandem.runtime.request_id import error_body
from tandem.tokenlog import ReplyGone
from tandem.v1.common_pb2 import FINISH_REASON_CONTENT_FILTER, FINISH_REASON_ERROR, SamplingParams, Usage
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)
IGNORED_FIELDS_HEADER = "X-Tandem-Ignored-Fields"
ROUTED_BY_HEADER = "X-Tandem-Routed-By"  # "quota_fallback": the quota sent the reply to the small model its `model` names
MAX_IGNORED_NAMES = 16
MAX_END_USER_CHARS = 64  # of the `user` field, in the log line
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
REPLY_LOST = "the reply's token log was lost before it ended; try again"
# What OpenAI's `system_fingerprint` stands for: the serving software that produced the answer.
SYSTEM_FINGERPRINT = f"tandem-{__version__}"


class ModelChoice(NamedTuple):
    model: ServedModel  # the model that answers
    fallback: Route | None = None  # where the reply goes when the user's quota cannot afford `model`


async def served_model(router: ModelRouter, tokenizer: Tokenizer, user: ApiKey, requested: str, text: str) -> ModelChoice:
    """The model that answers `text` (the request's last user message, or its prompt), as for the
    product API (services.chat.model_routing) but with no conversation to stay on; for `auto`, its
    quota fallback too (a named model is answered by that model or refused: 429, as vLLM's users expect)."""
    try:
        route = await router.route(user, requested, text, PromptCounter(tokenizer).count)
    except UnknownModel:
        raise NotFound(f"The model `{requested}` does not exist or is not served.", code="model_not_found", param="model") from None
    return ModelChoice(route.model, router.quota_fallback(route) if requested in AUTO else None)


class OpenAIAnswers:
    """Starts the OpenAI endpoints' replies (`starter`) and answers them, whole or streamed, read
    through `fanout`, each prompt within its tier's `prompt_budget` (ChatConfig.prompt_budget), their logprobs' tokens spelt by
    `tokenizer`; a reply whose client goes away is cancelled over `bus`. A request for `n` choices is `n` replies to one prompt
    (ReplyStarter.start_choices), answered together: a choice's object and chunks carry its index."""

    def __init__(
        self,
        starter: ReplyStarter,
        fanout: FanoutHub,
        bus: Bus,
        tokenizer: LoadedTokenizer,
        *,
        answer_lengths: Mapping[Tier, AnswerLength],
        prompt_budget: Callable[[Tier, int], Budget],
        keepalive_s: float,
    ) -> None:
        self._starter = starter
        self._tokenizer = tokenizer
        self._fanout = fanout
        self._bus = bus
        self._answer_lengths = answer_lengths
        self._prompt_budget = prompt_budget
        self._keepalive_s = keepalive_s

    async def answer(
        self,
        user: ApiKey,
        body: GenerationBody,
        choice: ModelChoice,
        prompt_ids: list[int],
        shape: ReplyShape,
        prompt_param: str,
        clock: ReplyClock,
        cleared: Callable[[], Awaitable[None]] | None = None,
        tool_style: str | None = None,
    ) -> JSONResponse | StreamResponse:
        """Starts the reply to `prompt_ids` (one per choice) and answers it as `body.stream` asks,
        measured by `clock` (the route holds the request's stream slot, services.chat.stream_slots,
        streamed or not). A prompt over the model's window is a 400 (`context_length_exceeded`,
        as OpenAI's), one within it but over the tier's budget a 413 (`prompt_too_long`, as the
        product API's). `cleared` (the input check's verdict) is awaited
        before the first reply's request is sent (services.chat.replies.ReplyRequest.cleared).
        `tool_style` (services.chat.openai_tools): the reply's tool calls are read out of its text.
        A single choice whose quota is spent is answered by `choice.fallback`'s model, which the
        answer's `model` names (and its ROUTED_BY_HEADER says why)."""
        model = choice.model
        room = model.window_tokens - len(prompt_ids)
        if room < 1:
            raise InvalidRequest(
                f"This model's maximum context length is {model.window_tokens} tokens; the {prompt_param} have {len(prompt_ids)}.",
                code="context_length_exceeded",
                param=prompt_param,
            )
        check_prompt_tokens(len(prompt_ids), self._prompt_budget(user.tier, model.window_tokens), prompt_param)
        sampling = body.sampling(self._answer_lengths[user.tier], room)
        reply_id = f"{shape.id_prefix}{new_reply_id()}"
        ignored = ignored_fields_text(body.ignored_fields())
        if ignored:
            log.info("%s: ignored the request's unknown fields %s", reply_id, ignored)
        if body.user:  # a client's own string: shown as ascii() shows it, cut short
            log.info("%s: for end user %s of %s", reply_id, ascii(body.user[:MAX_END_USER_CHARS]), user.user_id)
        head = {"id": reply_id, "created": int(time.time()), "model": model.name, "system_fingerprint": SYSTEM_FINGERPRINT}
        choices = [
            ReplyRequest(
                choice_reply_id(reply_id, i),
                user,
                model.name,
                prompt_ids,
                0,
                choice_sampling(sampling, i),
                cleared=cleared if i == 0 else None,
            )
            for i in range(body.n)
        ]
        fallback = choice.fallback
        if fallback is not None and body.n == 1 and len(prompt_ids) < fallback.model.window_tokens:
            small_room = fallback.model.window_tokens - len(prompt_ids)
            small = replace(
                choices[0],
                model=fallback.model.name,
                sampling=choice_sampling(body.sampling(self._answer_lengths[user.tier], small_room), 0),
                route=fallback,
            )
            choices[0] = replace(choices[0], fallback=small)
        reply_ids = [choice.reply_id for choice in choices]
        # One per choice: a text completion's offsets count its own choice's text.
        logprobs = [ReplyLogprobs(self._tokenizer.get(), shape.is_chat) for _ in choices] if sampling.HasField("top_logprobs") else None
        if not body.stream:
            head["model"], routed_by = await self._start(choices)
            try:
                whole = await self._whole(reply_ids, head, shape, clock, logprobs, tool_style)
                return _name_routed(_name_ignored(whole, ignored), routed_by)
            finally:
                clock.close()
        head["model"], routed_by = await self._start(choices)
        chunks = self.reply_chunks(reply_ids, head, shape, body.wants_usage_chunk, clock, logprobs, tool_style)
        response = sse_response(chunks, self._keepalive_s, sep=OPENAI_SEPARATOR)
        response.on_close(clock.close)
        return _name_routed(_name_ignored(response, ignored), routed_by)

    async def _start(self, choices: list[ReplyRequest]) -> tuple[str, str]:
        """The model that answers, and "quota_fallback" when the quota sent it there (else "")."""
        if len(choices) == 1:
            begun = await self._starter.start_reply(choices[0])
        else:
            begun = await self._starter.start_choices(choices, self._first_event)
        is_fallback = begun.route is not None and begun.route.decided_by is DecidedBy.QUOTA_FALLBACK
        return begun.model, DecidedBy.QUOTA_FALLBACK.value if is_fallback else ""

    async def _first_event(self, reply_id: str) -> None:
        """Returns once the reply's first event is in its log (its prompt is computed), or its log is
        gone (reading it again says so)."""
        with contextlib.suppress(ReplyGone):
            async with contextlib.aclosing(log_events(self._fanout, reply_id)) as events:
                async for _ in events:
                    return

    async def _whole(
        self,
        reply_ids: list[str],
        head: dict[str, object],
        shape: ReplyShape,
        clock: ReplyClock,
        logprobs: list[ReplyLogprobs] | None,
        tool_style: str | None = None,
    ) -> JSONResponse:
        parts: list[list[TokenEvent]] = [[] for _ in reply_ids]
        finals: dict[int, TokenEvent] = {}
        async with self._cancel_unless_finished(reply_ids) as finished:
            try:
                async with contextlib.aclosing(self._choice_events(reply_ids)) as events:
                    async for index, event in events:
                        parts[index].append(event)
                        if is_final(event):
                            finals[index] = event
            except ReplyGone:
                clock.close("expired")
                raise Unavailable(REPLY_LOST, code="reply_expired") from None
            finished.append(True)
        lasts = [finals[index] for index in range(len(reply_ids))]
        clock.final(choices_final(lasts))  # the whole answer goes out now
        failed = next((last for last in lasts if last.finish == FINISH_REASON_ERROR), None)
        if failed is not None:
            raise Unavailable(
                failed.error.message or "the reply failed", code=failed.error.code or "error", retry_after_s=failed.error.retry_after_s
            )
        # A reply the output check withdrew (finish content_filter) answers with none of its text.
        choices = []
        for index, (choice_events, last) in enumerate(zip(parts, lasts, strict=True)):
            withdrawn = last.finish == FINISH_REASON_CONTENT_FILTER
            text = "" if withdrawn else "".join(event.text for event in choice_events)
            choice_logprobs = None if logprobs is None or withdrawn else logprobs[index].of(choice_events)
            content: str | None = text
            calls: list[dict[str, Any]] = []
            if tool_style is not None and not withdrawn:
                content, calls = parse_tool_calls(text, tool_style)
            finish = "tool_calls" if calls else openai_finish_reason(last.finish)
            choices.append(shape.choice(index, content, finish, choice_logprobs, calls, last.stop_reason or None))
        usage = choices_final(lasts).usage
        return JSONResponse({**head, "object": shape.object_name, "choices": choices, "usage": _usage(usage)})

    async def reply_chunks(
        self,
        reply_ids: list[str],
        head: dict[str, object],
        shape: ReplyShape,
        include_usage: bool,
        clock: ReplyClock,
        logprobs: list[ReplyLogprobs] | None = None,
        tool_style: str | None = None,
    ) -> AsyncIterator[dict[str, str]]:
        """A streamed reply's SSE data, read from its choices' logs: chunks, each naming its choice's
        index, then `[DONE]`. A choice that fails, or whose log vanishes before its end, gives an
        `error` chunk instead of the rest. With `logprobs` (one per choice), a token's logprobs
        come in the chunk of its event's text (one with an empty delta when the detokenizer holds
        that text back). With `tool_style`, content streams until a call may begin; the calls come
        as `tool_calls` deltas when the choice ends (services.chat.openai_tools.ToolCallStream)."""

        def data(body: dict[str, object]) -> dict[str, str]:
            return {"data": json.dumps(body, ensure_ascii=False)}

        def chunk(choices: list[dict[str, object]], **extra: object) -> dict[str, str]:
            return data({**head, "object": shape.chunk_object, "choices": choices, **extra})

        def error(message: str, code: str) -> dict[str, str]:
            return data(error_body(code, message))

        if shape.is_chat:  # OpenAI's first chat chunk of each choice names the role
            for index in range(len(reply_ids)):
                yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        finals: dict[int, TokenEvent] = {}
        tool_streams = None if tool_style is None else [ToolCallStream(tool_style) for _ in reply_ids]
        async with self._cancel_unless_finished(reply_ids) as finished:
            try:
                async with contextlib.aclosing(self._choice_events(reply_ids)) as events:
                    async for index, event in events:
                        if event.finish == FINISH_REASON_ERROR:
                            yield error(event.error.message, event.error.code)
                            clock.final(event)
                            break
                        event_logprobs = None if logprobs is None else logprobs[index].of([event])
                        text = event.text if tool_streams is None else tool_streams[index].feed(event.text)
                        if text or event_logprobs:
                            yield chunk([shape.chunk_choice(index, text, None, event_logprobs)])
                        if event.text:
                            clock.content()
                        if is_final(event):
                            finish = openai_finish_reason(event.finish)
                            if tool_streams is not None and event.finish != FINISH_REASON_CONTENT_FILTER:
                                rest, calls = tool_streams[index].finish()
                                if rest:
                                    yield chunk([shape.chunk_choice(index, rest, None)])
                                for call_chunk in shape.tool_call_chunks(index, calls):
                                    yield chunk([call_chunk])
                                finish = "tool_calls" if calls else finish
                            yield chunk([shape.chunk_choice(index, "", finish, stop_reason=event.stop_reason or None)])
                            finals[index] = event
                    else:
                        lasts = [finals[index] for index in range(len(reply_ids))]
                        clock.final(choices_final(lasts))
                        if include_usage:
                            yield chunk([], usage=_usage(choices_final(lasts).usage))
                        finished.append(True)
            except ReplyGone:
                clock.close("expired")
                yield error(REPLY_LOST, "reply_expired")
        yield {"data": "[DONE]"}

    async def _choice_events(self, reply_ids: list[str]) -> AsyncGenerator[tuple[int, TokenEvent], None]:
        """Every choice's events as they land in its log, with its index, until each choice's final
        one; raises what reading a log raised (ReplyGone when one vanished)."""
        if len(reply_ids) == 1:
            async with contextlib.aclosing(log_events(self._fanout, reply_ids[0])) as events:
                async for event in events:
                    yield 0, event
            return
        landed: asyncio.Queue[tuple[int, TokenEvent | Exception | None]] = asyncio.Queue()

        async def read(index: int, reply_id: str) -> None:
            try:
                async for event in log_events(self._fanout, reply_id):
                    landed.put_nowait((index, event))
            except Exception as exc:  # raised by the reader below, in the request's task
                landed.put_nowait((index, exc))
            else:
                landed.put_nowait((index, None))

        readers = [asyncio.create_task(read(index, reply_id)) for index, reply_id in enumerate(reply_ids)]
        try:
            num_reading = len(readers)
            while num_reading:
                index, item = await landed.get()
                if item is None:
                    num_reading -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def _cancel_unless_finished(self, reply_ids: list[str]) -> AsyncIterator[list[bool]]:
        """An OpenAI client that goes away cannot resume: its replies are cancelled at once."""
        finished: list[bool] = []
        try:
            yield finished
        finally:
            if not finished:
                for reply_id in reply_ids:
                    with contextlib.suppress(Exception):
                        await cancel_reply(self._bus, reply_id, "client_gone")


def choice_reply_id(reply_id: str, index: int) -> str:
    """Choice `index`'s reply: the first is the request's own id (what `n: 1` always was)."""
    return reply_id if index == 0 else f"{reply_id}-{index}"


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: with a seed, choice i samples with seed + i (modulo 2**64), so
    the choices differ and the whole answer repeats; without one, each draws its own stream."""
    if index == 0 or not sampling.HasField("seed"):
        return sampling
    params = SamplingParams()
    params.CopyFrom(sampling)
    params.seed = (sampling.seed + index) % 2**64
    return params


def choices_final(lasts: list[TokenEvent]) -> TokenEvent:
    """The choices' final events as one: the first's, with usage counting the prompt once (every
    choice has the same), every choice's output tokens, and the most prompt tokens any choice
    read from the prefix cache (those after the first share its prompt's full blocks)."""
    together = TokenEvent()
    together.CopyFrom(lasts[0])
    together.usage.output_tokens = sum(last.usage.output_tokens for last in lasts)
    together.usage.cached_tokens = max(last.usage.cached_tokens for last in lasts)
    return together


def ignored_fields_text(names: list[str]) -> str:
    """The ignored fields as a header value: names a client chose, so only the first few, and each
    that is not a plain identifier as `?` (no control characters into a header or a log line)."""
    shown = [name if _PLAIN_NAME.fullmatch(name) else "?" for name in names[:MAX_IGNORED_NAMES]]
    more = len(names) - len(shown)
    return ", ".join(shown + ([f"... {more} more"] if more else []))


def _name_routed(response: JSONResponse | StreamResponse, routed_by: str) -> JSONResponse | StreamResponse:
    if routed_by:
        response.headers[ROUTED_BY_HEADER] = routed_by
    return response


def _name_ignored(response: JSONResponse | StreamResponse, ignored: str) -> JSONResponse | StreamResponse:
    if ignored:
        response.headers[IGNORED_FIELDS_HEADER] = ignored
    return response


def _usage(usage: Usage) -> dict[str, object]:
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
