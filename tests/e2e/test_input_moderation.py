"""The input check on the whole stack (chat's default: profanity-check's trained model): a
flagged message is refused with a 400 and a clear message, on the product API with code
`moderated` (the conversation shows the user turn as moderated, with no answer, and the next
turn's prompt leaves it out), through the OpenAI SDK as a BadRequestError with code
`content_filter`; it is counted in chat's metrics; plain messages are answered as before. The web
page shows the refusal's message beside the input, marks the turn and gives its text back."""

from __future__ import annotations

import httpx
import openai
import pytest
from product_stack import ALICE, read_stream, text_of
from prometheus_client.parser import text_string_to_metric_families
from test_web_page import browser, context, expect, send, signed_in_page  # noqa: F401 (the browser fixtures)

from services.chat.moderation import MODERATED_MESSAGE

pytestmark = pytest.mark.real_model
FLAGGED = "you are a fucking idiot"  # profanity-check scores it 1.0
PLAIN = "What is the capital of France?"
GREEDY = {"temperature": 0, "max_tokens": 8}


async def new_conversation(client: httpx.AsyncClient) -> str:
    response = await client.post("/v1/conversations", headers=ALICE, json={})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def post_message(client: httpx.AsyncClient, conversation_id: str, content: str):
    return client.stream(
        "POST",
        f"/v1/conversations/{conversation_id}/messages",
        headers={**ALICE, "Accept": "text/event-stream"},
        json={"content": content, **GREEDY},
    )


async def refused_input_count(client: httpx.AsyncClient, ops_url: str) -> float:
    """tandem_chat_moderated_total{direction="input"} of this chat instance, all tiers and models."""
    response = await client.get(f"{ops_url}/metrics")
    assert response.status_code == 200
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "tandem_chat_moderated_total" and sample.labels.get("direction") == "input"
    )


async def test_a_flagged_message_is_refused_stored_as_moderated_and_left_out_of_the_next_prompt(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        counted_before = await refused_input_count(client, product_stack.chat_ops_url)
        conversation_id = await new_conversation(client)
        async with post_message(client, conversation_id, FLAGGED) as response:
            body = await response.aread()
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert (error["code"], error["message"]) == ("moderated", MODERATED_MESSAGE)
        assert await refused_input_count(client, product_stack.chat_ops_url) == counted_before + 1

        shown = (await client.get(f"/v1/conversations/{conversation_id}", headers=ALICE)).json()
        assert [(m["role"], m["status"], m["content"]) for m in shown["messages"]] == [("user", "moderated", FLAGGED)]

        # The next message is answered, and its prompt is the one a fresh conversation sends.
        async with post_message(client, conversation_id, PLAIN) as response:
            after_refusal = await read_stream(response)
        async with post_message(client, await new_conversation(client), PLAIN) as response:
            fresh = await read_stream(response)
        assert after_refusal[-1].event == "done" and text_of(after_refusal)
        assert after_refusal[-1].data["usage"]["input"] == fresh[-1].data["usage"]["input"]
        shown = (await client.get(f"/v1/conversations/{conversation_id}", headers=ALICE)).json()
        assert [(m["role"], m["status"]) for m in shown["messages"]] == [
            ("user", "moderated"),
            ("user", "complete"),
            ("assistant", "complete"),
        ]


async def replies_started(client: httpx.AsyncClient, ops_url: str) -> float:
    response = await client.get(f"{ops_url}/metrics")
    assert response.status_code == 200
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "tandem_chat_replies_started_total"
    )


async def test_the_openai_sdk_gets_a_bad_request_with_code_content_filter(product_stack):
    """The OpenAI endpoints wait for the check's verdict once the reply is recorded and its quota
    reserved (services.chat.replies.ReplyRequest.cleared): a refused one still starts no reply and
    keeps none of its reservation."""
    client = openai.AsyncOpenAI(base_url=f"{product_stack.url}/v1", api_key="key-alice", max_retries=0, timeout=120)
    model = (await client.models.list()).data[0].id
    earlier = [{"role": "user", "content": PLAIN}, {"role": "assistant", "content": "Paris."}]
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as http:
        started_before = await replies_started(http, product_stack.chat_ops_url)
        level = await http.get("/v1/models", headers=ALICE)
        remaining_before = int(level.headers["x-ratelimit-remaining-tokens"])
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=model, messages=[*earlier, {"role": "user", "content": FLAGGED}], **GREEDY)
        assert (refused.value.status_code, refused.value.code) == (400, "content_filter")
        assert refused.value.body["message"] == MODERATED_MESSAGE
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=model, prompt=FLAGGED, stream=True, **GREEDY)
        assert refused.value.code == "content_filter"
        # The bucket only refills meanwhile: a reservation kept would have taken its worst case.
        assert int(refused.value.response.headers["x-ratelimit-remaining-tokens"]) >= remaining_before
        assert await replies_started(http, product_stack.chat_ops_url) == started_before

    plain = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": PLAIN}], **GREEDY)
    assert plain.choices[0].message.content and plain.choices[0].finish_reason in ("stop", "length")


async def test_the_page_says_why_beside_the_input_marks_the_turn_and_gives_the_text_back(product_stack, context):  # noqa: F811
    page = await signed_in_page(context, product_stack.url)
    await send(page, FLAGGED)

    banner = page.locator("#banner")  # just above the input
    await expect(banner).to_have_text(MODERATED_MESSAGE)
    user_turn = page.locator('.message[data-role="user"]')
    await expect(user_turn).to_have_count(1)
    await expect(user_turn).to_have_attribute("data-status", "moderated")
    await expect(user_turn.locator(".status")).to_contain_text("safety check")
    await expect(page.locator('.message[data-role="assistant"]')).to_have_count(0)
    assert await page.input_value("#input") == FLAGGED  # to rephrase
