"""OpenAI's legacy `POST /v1/completions`: a prompt in (text, or token ids as vLLM accepts), text
out, whole or streamed, through the same machinery as chat completions. One prompt per request:
a batch of prompts is refused; `n` choices of the one are answered. The prompt meets the product
API's caps as a chat completion's messages do (services.chat.openai_api)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from services.chat.deps import Answers, Arrived, Chat, CurrentUser, Router, StreamAdmission
from services.chat.errors import InvalidRequest
from services.chat.latency import ReplyClock
from services.chat.limits import TopLogprobs
from services.chat.moderation import refuse_openai_input, start_input_check
from services.chat.openai_replies import served_model
from services.chat.openai_schemas import GenerationBody
from services.chat.openai_shape import TEXT
from services.chat.prompt_limits import check_message_chars
from tandem.models.tokenizer import Tokenizer

router = APIRouter(prefix="/v1", tags=["openai"])


class TextCompletionBody(GenerationBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    # The legacy form: a count (0 = the chosen tokens' logprobs alone); `false` or null = none.
    logprobs: TopLogprobs | Literal[False] | None = None

    def requested_top_logprobs(self) -> int | None:
        return None if self.logprobs is None or self.logprobs is False else self.logprobs

    def only_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids (a list of one of either is that one)."""
        prompts: list[str | list[int]]
        if isinstance(self.prompt, str):
            prompts = [self.prompt]
        elif all(isinstance(item, int) for item in self.prompt):
            prompts = [[item for item in self.prompt if isinstance(item, int)]]
        else:
            prompts = [item for item in self.prompt if not isinstance(item, int)]
        if len(prompts) != 1:
            raise InvalidRequest(f"`prompt` has {len(prompts)} prompts; Tandem completes one per request", param="prompt")
        if not prompts[0]:
            raise InvalidRequest("`prompt` is empty", param="prompt")
        return prompts[0]


@router.post("/completions", response_model=None)
async def completions(
    state: Chat,
    router: Router,
    answers: Answers,
    user: CurrentUser,
    slot: StreamAdmission,  # taken before the reply starts, streamed or not (503/429 past a limit)
    arrived: Arrived,
    body: TextCompletionBody,
) -> JSONResponse | EventSourceResponse:
    body.refuse_unsupported()
    prompt = body.only_prompt()
    if isinstance(prompt, str):  # a text's characters; token ids meet the prompt budget alone
        check_message_chars(prompt, state.config.max_message_chars, "prompt")
    state.door.check_all(user.tier, state.models.models)  # before any work for a prompt that cannot start
    tokenizer = state.tokenizer.get()
    if isinstance(prompt, str):
        checking = start_input_check(state.input_check, prompt)  # in its process, while tokenizing
        prompt_ids = await _prompt_ids(tokenizer, prompt)
    else:  # token ids: checked as the text they spell, once they are known to be in the vocabulary
        prompt_ids = await _prompt_ids(tokenizer, prompt)
        checking = start_input_check(state.input_check, tokenizer.decode(prompt_ids))
    text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
    choice = await served_model(router, tokenizer, user, body.model, text)  # for `auto`, by how hard the prompt reads
    cleared = partial(refuse_openai_input, checking, user.tier.value, choice.model.name)  # awaited as the reply starts
    clock = ReplyClock(user.tier.value, choice.model.name, arrived)
    return await answers.answer(user, body, choice, prompt_ids, TEXT, "prompt", clock, cleared)


async def _prompt_ids(tokenizer: Tokenizer, prompt: str | list[int]) -> list[int]:
    """A text prompt is encoded with the model's BOS, as vLLM does; token ids are checked against
    the vocabulary and sent as they are."""
    if isinstance(prompt, str):
        return await asyncio.to_thread(tokenizer.encode, prompt, True)
    outside = next((t for t in prompt if not 0 <= t < tokenizer.vocab_size), None)
    if outside is not None:
        raise InvalidRequest(f"token id {outside} is outside the vocabulary (0 to {tokenizer.vocab_size - 1})", param="prompt")
    return prompt
