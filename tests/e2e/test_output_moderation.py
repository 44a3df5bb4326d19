"""The output check end to end, with the real model: an answer that trips it is withdrawn while it
streams. The web page (chromium, Playwright) shows the first words, then hides them and says why;
the official OpenAI SDK's stream ends with finish_reason "content_filter", and a whole answer
comes back with no text; the stored turn is moderated without its text.

The lean stack (tests/e2e/conftest.py: router, decode worker, relay, chat, on servers of their
own), whose relay's check is a blocklist of one word, "kumquat": asked to repeat a sentence that
starts with it, SmolLM2 writes it within its first tokens (greedy: "The kumquat tree is green, the
sea is calm today, ..."), long before the answer ends, so the check at the 8th token trips
mid-stream. No other e2e prompt or answer mentions it, and the product stack keeps the default
check, so no other test's answer can be withdrawn. The page
sends temperature 0 (its request is rewritten on the way out) so the answer is the greedy one."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers import wait_until
from product_stack import ALICE, BLOCKED

pytestmark = pytest.mark.real_model

PROMPT = "Repeat after me: The kumquat tree is green, the sea is calm today, the sky is blue and the birds are singing in the old garden."
REPLY_TIMEOUT_MS = 90_000


@pytest.fixture
def stack(lean_stack):
    return lean_stack


async def served_model(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, headers=ALICE) as client:
        return (await client.get("/v1/models")).json()["data"][0]["id"]


async def test_the_openai_sdk_stream_ends_with_content_filter_and_a_whole_answer_has_no_text(stack):
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="key-alice", max_retries=0, timeout=120)
    model = await served_model(stack.url)
    messages = [{"role": "user", "content": PROMPT}]
    texts, finishes = [], []
    stream = await client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=48, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            finishes.append(choice.finish_reason)
    streamed = "".join(texts)
    assert BLOCKED in streamed.lower(), f"the model did not write the blocked word, so nothing tripped: {streamed!r}"
    assert [f for f in finishes if f] == ["content_filter"]
    # Withdrawn at a check's turn, not at the end: the answer is cut short of the sentence.
    assert "old garden" not in streamed, streamed

    whole = await client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=48)
    choice = whole.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("content_filter", "")
    assert whole.usage.completion_tokens > 0
    await client.close()


async def test_the_page_hides_a_withdrawn_answer_mid_stream_and_says_why(stack):
    import test_web_page as web  # its browser helpers; without chromium it skips (or, where one is required, fails)

    if web.NO_BROWSER:
        pytest.fail(f"{web.NO_BROWSER} (TANDEM_REQUIRE_BROWSER=1)", pytrace=False)
    expect = web.expect
    async with web.async_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=web.CHROMIUM)
        context = await browser.new_context()
        await context.add_init_script(web.RECORD_GROWTH)
        page_errors: list[str] = []
        context.on("weberror", lambda error: page_errors.append(str(error.error)))
        context.on("console", lambda message: page_errors.append(message.text) if message.text.startswith("tandem:") else None)
        try:
            page = await web.signed_in_page(context, stack.url)
            await page.route("**/v1/conversations/*/messages", _greedy)
            await web.send(page, PROMPT)
            answer = web.answers(page).last
            await expect(answer).to_have_attribute("data-status", "moderated", timeout=REPLY_TIMEOUT_MS)
            growth = await page.evaluate("window.__growth")
            assert growth and growth[-1] > 0, f"no text was shown before the answer was withdrawn: lengths {growth}"
            await expect(answer.locator(".content")).to_have_text("")
            assert await web.source_of(answer) == ""
            await expect(answer.locator(".status")).to_have_text("Withheld by the safety check")
            await expect(answer.locator(".error-line")).to_contain_text("withdrawn")

            conversation_id = web.conversation_id_of(page)
            conversation = await web.stored(stack.url, conversation_id)
            assert [(m["role"], m["status"]) for m in conversation["messages"]] == [("user", "complete"), ("assistant", "moderated")]
            assert conversation["messages"][1]["content"] == ""

            await page.reload()  # as stored: still withdrawn, still saying so
            await expect(web.answers(page).last).to_have_attribute("data-status", "moderated")
            await expect(web.answers(page).last.locator(".content")).to_have_text("")
        finally:
            await context.close()
            await browser.close()
    assert not page_errors, f"the page reported errors: {page_errors}"


async def test_the_stored_turn_of_a_withdrawn_answer_is_moderated_without_text(stack):
    async with httpx.AsyncClient(base_url=stack.url, headers=ALICE, timeout=120) as client:
        conversation_id = (await client.post("/v1/conversations", json={})).json()["id"]
        body = {"content": PROMPT, "temperature": 0}
        async with client.stream("POST", f"/v1/conversations/{conversation_id}/messages", json=body) as response:
            assert response.status_code == 200
            events = [line.removeprefix("event: ") async for line in response.aiter_lines() if line.startswith("event: ")]
        assert events[0] == "meta" and events[-1] == "moderated" and "delta" in events and "done" not in events

        async def settled():
            messages = (await client.get(f"/v1/conversations/{conversation_id}")).json()["messages"]
            return messages if messages[-1]["status"] != "running" else None

        messages = await wait_until(settled)
        assert (messages[-1]["status"], messages[-1]["content"]) == ("moderated", "")


async def _greedy(route) -> None:
    """The page's message request with temperature 0: the answer is the one the model writes greedily."""
    body = json.loads(route.request.post_data or "{}")
    await route.continue_(post_data=json.dumps({**body, "temperature": 0}))
