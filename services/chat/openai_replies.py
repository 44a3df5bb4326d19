"""What the OpenAI endpoints share once they have a prompt's token ids: check it fits the model,
start the reply, and answer it whole or as SSE chunks read from its token log. A `ReplyShape`
says how one endpoint writes its objects (chat: `message`/`delta`; text: `text`). Replies are
not stored as conversations; a client that goes away cannot resume, so its reply is cancelled."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from services.chat.errors import InvalidRequest, NotFound, Unavailable
from services.chat.fanout import FanoutHub
from services.chat.latency import ReplyClock
from services.chat.model_routing import ModelRouter, UnknownModel
from services.chat.models_view import ServedModel
from services.chat.openai_logprobs import ReplyLogprobs
from services.chat.openai_schemas import GenerationBody, openai_finish_reason
from services.chat.prompt import LoadedTokenizer, PromptCounter
from services.chat.replies import ReplyRequest, ReplyStarter, cancel_reply, new_reply_id
from services.chat.sse import StreamResponse, sse_response
from services.chat.stream_slots import StreamSlots
from services.chat.streaming import log_events
from tandem import __version__
from tandem.bus import Bus
from tandem.bus.events import is_final
from tandem.config import ApiKey
from tandem.models.tokenizer import Tokenizer
from tandem.runtime.request_id import error_body
from tandem.tokenlog import ReplyGone
from tandem.v1.common_pb2 import FINISH_REASON_CONTENT_FILTER, FINISH_REASON_ERROR, Usage
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)
IGNORED_FIELDS_HEADER = "X-Tandem-Ignored-Fields"
MAX_IGNORED_NAMES = 16
MAX_END_USER_CHARS = 64  # of the `user` field, in the log line
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
REPLY_LOST = "the reply's token log was lost before it ended; try again"
# What OpenAI's `system_fingerprint` stands for: the serving software that produced the answer.
SYSTEM_FINGERPRINT = f"tandem-{__version__}"


@dataclass(frozen=True)
class ReplyShape:
    """How one endpoint writes a reply: id prefix, object names, and a choice's form."""

    id_prefix: str
    object_name: str
    chunk_object: str
    is_chat: bool

    def choice(self, text: str, finish: str, logprobs: dict[str, object] | None = None) -> dict[str, object]:
        """`logprobs` (openai_logprobs.py): a chat choice has the key only when the request asked."""
        if self.is_chat:
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, **({"logprobs": logprobs} if logprobs else {}), "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def chunk_choice(self, text: str, finish: str | None, logprobs: dict[str, object] | None = None) -> dict[str, object]:
        if self.is_chat:
            delta = {"content": text} if text else {}
            return {"index": 0, "delta": delta, **({"logprobs": logprobs} if logprobs else {}), "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}


CHAT = ReplyShape("chatcmpl-", "chat.completion", "chat.completion.chunk", is_chat=True)
TEXT = ReplyShape("cmpl-", "text_completion", "text_completion", is_chat=False)


async def served_model(router: ModelRouter, tokenizer: Tokenizer, user: ApiKey, requested: str, text: str) -> ServedModel:
    """The model that answers `text` (the request's last user message, or its prompt), as for the
    product API (services.chat.model_routing) but with no conversation to stay on."""
    try:
        route = await router.route(user, requested, text, PromptCounter(tokenizer).count)
    except UnknownModel:
        raise NotFound(f"The model `{requested}` does not exist or is not served.", code="model_not_found", param="model") from None
    return route.model


class OpenAIAnswers:
    """Starts the OpenAI endpoints' replies (`starter`) and answers them, whole or streamed (taking
    a stream slot of `stream_slots`), read through `fanout`, their logprobs' tokens spelt by
    `tokenizer`; a reply whose client goes away is cancelled over `bus`."""

    def __init__(
        self,
        starter: ReplyStarter,
        stream_slots: StreamSlots,
        fanout: FanoutHub,
        bus: Bus,
        tokenizer: LoadedTokenizer,
        *,
        max_answer_tokens: int,
        keepalive_s: float,
    ) -> None:
        self._starter = starter
        self._tokenizer = tokenizer
        self._stream_slots = stream_slots
        self._fanout = fanout
        self._bus = bus
        self._max_answer_tokens = max_answer_tokens
        self._keepalive_s = keepalive_s

    async def answer(
        self,
        user: ApiKey,
        body: GenerationBody,
        model: ServedModel,
        prompt_ids: list[int],
        shape: ReplyShape,
        prompt_param: str,
        clock: ReplyClock,
        cleared: Callable[[], Awaitable[None]] | None = None,
    ) -> JSONResponse | StreamResponse:
        """Starts the reply to `prompt_ids` and answers it as `body.stream` asks, measured by `clock`; a
        stream takes one of the instance's and the user's stream slots (services.chat.stream_slots)
        until it ends. `cleared` (the input check's verdict) is awaited before the reply's request is
        sent (services.chat.replies.ReplyRequest.cleared)."""
        room = model.window_tokens - len(prompt_ids)
        if room < 1:
            raise InvalidRequest(
                f"This model's maximum context length is {model.window_tokens} tokens; the {prompt_param} have {len(prompt_ids)}.",
                code="context_length_exceeded",
                param=prompt_param,
            )
        sampling = body.sampling(self._max_answer_tokens, room)
        reply_id = f"{shape.id_prefix}{new_reply_id()}"
        ignored = ignored_fields_text(body.ignored_fields())
        if ignored:
            log.info("%s: ignored the request's unknown fields %s", reply_id, ignored)
        if body.user:  # a client's own string: shown as ascii() shows it, cut short
            log.info("%s: for end user %s of %s", reply_id, ascii(body.user[:MAX_END_USER_CHARS]), user.user_id)
        head = {"id": reply_id, "created": int(time.time()), "model": model.name, "system_fingerprint": SYSTEM_FINGERPRINT}
        reply = ReplyRequest(reply_id, user, model.name, prompt_ids, 0, sampling, cleared=cleared)
        logprobs = ReplyLogprobs(self._tokenizer.get(), shape.is_chat) if sampling.HasField("top_logprobs") else None
        if not body.stream:
            head["model"] = await self._starter.start_reply(reply)
            try:
                return _name_ignored(await self._whole(reply_id, head, shape, clock, logprobs), ignored)
            finally:
                clock.close()
        slot = self._stream_slots.admit(user)  # before the reply starts: a refused stream begins nothing
        try:
            head["model"] = await self._starter.start_reply(reply)
        except BaseException:
            slot.release()
            raise
        chunks = self.reply_chunks(reply_id, head, shape, body.wants_usage_chunk, clock, logprobs)
        response = sse_response(chunks, self._keepalive_s)
        response.on_close(slot.release)
        response.on_close(clock.close)
        return _name_ignored(response, ignored)

    async def _whole(
        self, reply_id: str, head: dict[str, object], shape: ReplyShape, clock: ReplyClock, logprobs: ReplyLogprobs | None
    ) -> JSONResponse:
        events: list[TokenEvent] = []
        last = TokenEvent()
        async with self._cancel_unless_finished(reply_id) as finished:
            try:
                async for event in log_events(self._fanout, reply_id):
                    events.append(event)
                    last = event
            except ReplyGone:
                clock.close("expired")
                raise Unavailable(REPLY_LOST, code="reply_expired") from None
            finished.append(True)
        clock.final(last)  # the whole answer goes out now
        if last.finish == FINISH_REASON_ERROR:
            raise Unavailable(
                last.error.message or "the reply failed", code=last.error.code or "error", retry_after_s=last.error.retry_after_s
            )
        # A reply the output check withdrew (finish content_filter) answers with none of its text.
        withdrawn = last.finish == FINISH_REASON_CONTENT_FILTER
        text = "" if withdrawn else "".join(event.text for event in events)
        choice_logprobs = None if logprobs is None or withdrawn else logprobs.of(events)
        choice = shape.choice(text, openai_finish_reason(last.finish), choice_logprobs)
        return JSONResponse({**head, "object": shape.object_name, "choices": [choice], "usage": _usage(last.usage)})

    async def reply_chunks(
        self,
        reply_id: str,
        head: dict[str, object],
        shape: ReplyShape,
        include_usage: bool,
        clock: ReplyClock,
        logprobs: ReplyLogprobs | None = None,
    ) -> AsyncIterator[dict[str, str]]:
        """A streamed reply's SSE data, read from its log: chunks, then `[DONE]`. A reply that fails,
        or whose log vanishes before its end, gives an `error` chunk instead of the rest. With
        `logprobs`, a token's logprobs come in the chunk of its event's text (one with an empty
        delta when the detokenizer holds that text back)."""

        def data(body: dict[str, object]) -> dict[str, str]:
            return {"data": json.dumps(body, ensure_ascii=False)}

        def chunk(choices: list[dict[str, object]], **extra: object) -> dict[str, str]:
            return data({**head, "object": shape.chunk_object, "choices": choices, **extra})

        def error(message: str, code: str) -> dict[str, str]:
            return data(error_body(code, message))

        if shape.is_chat:  # OpenAI's first chat chunk names the role
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        async with self._cancel_unless_finished(reply_id) as finished:
            try:
                async for event in log_events(self._fanout, reply_id):
                    if event.finish == FINISH_REASON_ERROR:
                        yield error(event.error.message, event.error.code)
                        clock.final(event)
                        break
                    event_logprobs = None if logprobs is None else logprobs.of([event])
                    if event.text or event_logprobs:
                        yield chunk([shape.chunk_choice(event.text, None, event_logprobs)])
                    if event.text:
                        clock.content()
                    if is_final(event):
                        yield chunk([shape.chunk_choice("", openai_finish_reason(event.finish))])
                        clock.final(event)
                        if include_usage:
                            yield chunk([], usage=_usage(event.usage))
            except ReplyGone:
                clock.close("expired")
                yield error(REPLY_LOST, "reply_expired")
            else:
                finished.append(True)
        yield {"data": "[DONE]"}

    @contextlib.asynccontextmanager
    async def _cancel_unless_finished(self, reply_id: str) -> AsyncIterator[list[bool]]:
        """An OpenAI client that goes away cannot resume: its reply is cancelled at once."""
        finished: list[bool] = []
        try:
            yield finished
        finally:
            if not finished:
                with contextlib.suppress(Exception):
                    await cancel_reply(self._bus, reply_id, "client_gone")


def ignored_fields_text(names: list[str]) -> str:
    """The ignored fields as a header value: names a client chose, so only the first few, and each
    that is not a plain identifier as `?` (no control characters into a header or a log line)."""
    shown = [name if _PLAIN_NAME.fullmatch(name) else "?" for name in names[:MAX_IGNORED_NAMES]]
    more = len(names) - len(shown)
    return ", ".join(shown + ([f"... {more} more"] if more else []))


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
