"""The OpenAI endpoints meet the product API's caps, against a stack of their own (router, decode
worker, relay, chat; a free tier of one stream per key, a 300-token prompt budget, a 2,000-unit
quota, and a 400-character message limit): a non-streamed completion holds a stream slot while it
runs, so a second request of the same key is refused 429 `too_many_streams` as a second product
stream is; a message over the character limit and a prompt over the free tier's budget are 413s
on both endpoints; a flagged user message anywhere in the request, not only the last, is refused
`content_filter`; `/tokenize` and `/detokenize` draw on the caller's token quota and are refused
429 `quota_exceeded` once it is spent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio
from helpers import wait_until
from product_stack import LEAN_ROLES, ProductStack, own_product_stack
from scraped_metrics import scrape, total

from services.chat.moderation import MODERATED_MESSAGE

pytestmark = pytest.mark.real_model
KEYS = {"alice": "plus", "bob": "free", "dave": "free", "erin": "free"}
MAX_MESSAGE_CHARS = 400
PROMPT_BUDGET_FREE = 300
MAX_ANSWER_TOKENS = 24  # kept free for the answer: a free prompt may have 276 tokens
QUOTA_FREE = 2000
FLAGGED = "you are a fucking idiot"  # profanity-check (chat's default input check) scores it 1.0
PLAIN = "What is the capital of France?"
LONG_TURN = "apple " * 30  # 180 characters, about 31 tokens
FULL_REFILL_S = 10800  # the default quota_refill_s


def key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{name}"}


@pytest_asyncio.fixture(scope="module")
async def caps_stack(tmp_path_factory) -> AsyncIterator[ProductStack]:
    env = {
        "TANDEM_API_KEYS": ",".join(f"key-{name}={name}:{tier}" for name, tier in KEYS.items()),
        "TANDEM_STREAM_LIMIT_FREE": "1",
        "TANDEM_MAX_MESSAGE_CHARS": str(MAX_MESSAGE_CHARS),
        "TANDEM_PROMPT_BUDGET_FREE": str(PROMPT_BUDGET_FREE),
        "TANDEM_MAX_ANSWER_TOKENS": str(MAX_ANSWER_TOKENS),
        "TANDEM_QUOTA_FREE": str(QUOTA_FREE),
    }
    async with own_product_stack(tmp_path_factory.mktemp("openai-caps"), roles=LEAN_ROLES, **env) as stack:
        yield stack


async def streams_open(client: httpx.AsyncClient, ops_url: str) -> float:
    return total(await scrape(client, ops_url), "tandem_chat_streams_open")


def completion(content: str = PLAIN, **extra: object) -> dict[str, object]:
    return {"model": "auto", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 4, **extra}


def assert_refused(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


async def test_a_non_streamed_completion_holds_a_stream_slot_until_it_is_answered(caps_stack):
    async with httpx.AsyncClient(base_url=caps_stack.url, timeout=60) as client:
        conversation_id = (await client.post("/v1/conversations", headers=key("bob"), json={})).json()["id"]
        assert await streams_open(client, caps_stack.chat_ops_url) == 0
        with caps_stack.relays_paused():
            first = asyncio.create_task(client.post("/v1/chat/completions", headers=key("bob"), json=completion()))
            with _cancelled_on_error(first):
                await wait_until(lambda: _holds(client, caps_stack.chat_ops_url, 1), timeout_s=15)
                for path, body in (("/v1/chat/completions", completion()), ("/v1/completions", {"model": "auto", "prompt": PLAIN})):
                    second = await client.post(path, headers=key("bob"), json=body)
                    error = assert_refused(second, 429, "too_many_streams")
                    assert error["type"] == "rate_limit_exceeded" and int(second.headers["Retry-After"]) >= 1
                # The product API's streams share the slots: refused the same way.
                url = f"/v1/conversations/{conversation_id}/messages"
                assert_refused(await client.post(url, headers=key("bob"), json={"content": PLAIN}), 429, "too_many_streams")
                assert not first.done(), "the first completion cannot end while the relay is paused"
        answered = await asyncio.wait_for(first, 60)
        assert answered.status_code == 200 and answered.json()["object"] == "chat.completion", answered.text
        await wait_until(lambda: _holds(client, caps_stack.chat_ops_url, 0), timeout_s=30)  # given back once the answer is sent
        again = await client.post("/v1/completions", headers=key("bob"), json={"model": "auto", "prompt": PLAIN, "max_tokens": 2})
        assert again.status_code == 200, again.text


@contextlib.contextmanager
def _cancelled_on_error(task: asyncio.Task) -> Iterator[None]:
    try:
        yield
    except BaseException:
        task.cancel()
        raise


async def _holds(client: httpx.AsyncClient, ops_url: str, num_open: int) -> bool:
    return await streams_open(client, ops_url) == num_open


async def test_a_message_over_the_character_limit_is_413_on_both_endpoints_as_on_the_product_api(caps_stack):
    too_long = "a" * (MAX_MESSAGE_CHARS + 1)
    async with httpx.AsyncClient(base_url=caps_stack.url, timeout=60) as client:
        conversation_id = (await client.post("/v1/conversations", headers=key("erin"), json={})).json()["id"]
        product = await client.post(f"/v1/conversations/{conversation_id}/messages", headers=key("erin"), json={"content": too_long})
        assert_refused(product, 413, "message_too_long", "content")
        earlier = [{"role": "user", "content": too_long}, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": PLAIN}]
        for name in ("erin", "alice"):  # the limit is every tier's
            chat = await client.post("/v1/chat/completions", headers=key(name), json={**completion(), "messages": earlier})
            error = assert_refused(chat, 413, "message_too_long", "messages")
            assert error["type"] == "invalid_request_error"
            text = await client.post("/v1/completions", headers=key(name), json={"model": "auto", "prompt": too_long})
            assert_refused(text, 413, "message_too_long", "prompt")


async def test_a_prompt_over_the_free_tiers_budget_is_413_and_within_a_plus_tiers_it_is_answered(caps_stack):
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": LONG_TURN} for i in range(11)]  # each within the limit
    async with httpx.AsyncClient(base_url=caps_stack.url, timeout=60) as client:
        counted = await client.post("/tokenize", headers=key("alice"), json={"messages": turns})
        assert counted.json()["count"] > PROMPT_BUDGET_FREE - MAX_ANSWER_TOKENS, counted.json()["count"]
        chat = await client.post("/v1/chat/completions", headers=key("erin"), json={**completion(), "messages": turns})
        error = assert_refused(chat, 413, "prompt_too_long", "messages")
        assert f"at most {PROMPT_BUDGET_FREE - MAX_ANSWER_TOKENS}" in error["message"]
        ids = counted.json()["tokens"]
        text = await client.post("/v1/completions", headers=key("erin"), json={"model": "auto", "prompt": ids, "max_tokens": 2})
        assert_refused(text, 413, "prompt_too_long", "prompt")
        # Within the budget, the same tier is answered; the plus tier's budget holds the long prompt.
        short = await client.post("/v1/completions", headers=key("erin"), json={"model": "auto", "prompt": ids[:200], "max_tokens": 2})
        assert short.status_code == 200, short.text
        plus = await client.post("/v1/chat/completions", headers=key("alice"), json={**completion(), "messages": turns})
        assert plus.status_code == 200, plus.text


async def test_a_flagged_earlier_user_message_is_refused_not_only_the_last(caps_stack):
    async with httpx.AsyncClient(base_url=caps_stack.url, timeout=60) as client:
        for first in (FLAGGED, PLAIN):
            messages = [
                {"role": "user", "content": first},
                {"role": "assistant", "content": "Let us talk about something else."},
                {"role": "user", "content": PLAIN},
            ]
            response = await client.post("/v1/chat/completions", headers=key("alice"), json={**completion(), "messages": messages})
            if first == FLAGGED:
                error = assert_refused(response, 400, "content_filter")
                assert error["message"] == MODERATED_MESSAGE
            else:
                assert response.status_code == 200, response.text


def remaining_of(response: httpx.Response) -> int:
    return int(response.headers["x-ratelimit-remaining-tokens"])


async def test_tokenize_and_detokenize_draw_on_the_quota_and_are_refused_once_it_is_spent(caps_stack):
    refill = QUOTA_FREE / FULL_REFILL_S * 120  # at most, in the time this test takes
    async with httpx.AsyncClient(base_url=caps_stack.url, timeout=60) as client:
        assert remaining_of(await client.get("/v1/models", headers=key("dave"))) == QUOTA_FREE
        counted = await client.post("/tokenize", headers=key("dave"), json={"prompt": LONG_TURN})
        assert counted.status_code == 200, counted.text
        spent = counted.json()["count"]
        assert QUOTA_FREE - spent <= remaining_of(counted) <= QUOTA_FREE - spent + refill
        empty = await client.post("/tokenize", headers=key("dave"), json={"prompt": "", "add_special_tokens": False})
        assert empty.status_code == 200 and empty.json()["count"] == 0
        spent += 1  # every call counts, at least one unit
        assert QUOTA_FREE - spent <= remaining_of(empty) <= QUOTA_FREE - spent + refill
        tokens = (counted.json()["tokens"] * 40)[:1200]  # more than the bucket holds after it
        decoded = await client.post("/detokenize", headers=key("dave"), json={"tokens": tokens})
        assert decoded.status_code == 200, decoded.text
        spent += len(tokens)
        assert QUOTA_FREE - spent <= remaining_of(decoded) <= QUOTA_FREE - spent + refill

        refused = await client.post("/detokenize", headers=key("dave"), json={"tokens": tokens})
        error = assert_refused(refused, 429, "quota_exceeded")
        assert error["type"] == "rate_limit_exceeded" and int(refused.headers["Retry-After"]) >= 60
        assert remaining_of(refused) <= QUOTA_FREE - spent + refill, "a refused call takes nothing"
        assert_refused(await client.post("/tokenize", headers=key("dave"), json={"prompt": LONG_TURN * 40}), 429, "quota_exceeded")
        whole = await client.post("/detokenize", headers=key("dave"), json={"tokens": (tokens * 3)[: QUOTA_FREE + 1]})
        assert_refused(whole, 400, "exceeds_quota", "tokens")
        # Another key's bucket is its own.
        assert (await client.post("/detokenize", headers=key("erin"), json={"tokens": tokens})).status_code == 200
