"""Feedback and the regenerate rate on the real stack (the session's product stack): an answer's
rating is stored and read back with the conversation's messages, a second rating replaces it,
another user gets 404, and chat's /metrics counts the votes (tandem_feedback_total) and the
regenerations beside the answers (tandem_regenerations_total over tandem_answers_total) by the
model version that wrote the answer."""

from __future__ import annotations

import httpx
import pytest
from helpers import wait_until
from product_stack import ALICE, BOB, read_stream
from scraped_metrics import grew, scrape

pytestmark = pytest.mark.real_model
GREEDY = {"temperature": 0, "max_tokens": 12}


async def answered(client: httpx.AsyncClient, conversation_id: str, content: str) -> str:
    """The id of the answer to a new message, once stored as final."""
    async with client.stream(
        "POST",
        f"/v1/conversations/{conversation_id}/messages",
        headers={**ALICE, "Accept": "text/event-stream"},
        json={"content": content, **GREEDY},
    ) as response:
        events = await read_stream(response)
    assert events[-1].event == "done", events
    answer_id = events[0].data["message_id"]
    await final(client, conversation_id, answer_id)
    return answer_id


async def final(client: httpx.AsyncClient, conversation_id: str, message_id: str) -> dict:
    async def check() -> dict | None:
        found = [m for m in await tree(client, conversation_id) if m["id"] == message_id]
        return found[0] if found and found[0]["status"] != "running" else None

    return await wait_until(check)


async def tree(client: httpx.AsyncClient, conversation_id: str) -> list[dict]:
    response = await client.get(f"/v1/conversations/{conversation_id}", headers=ALICE)
    assert response.status_code == 200, response.text
    return response.json()["tree"]


async def test_a_rating_is_stored_with_the_answer_replaced_by_the_next_hidden_from_others_and_counted(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        conversation_id = (await client.post("/v1/conversations", headers=ALICE, json={})).json()["id"]
        answer_id = await answered(client, conversation_id, "Name a colour.")
        question, answer = await tree(client, conversation_id)
        assert (question["feedback"], answer["feedback"]) == (None, None)
        labels = {"model": answer["model"].partition("@")[0], "version": answer["model"].partition("@")[2]}
        before = await scrape(client, product_stack.chat_ops_url)

        url = f"/v1/messages/{answer_id}/feedback"
        assert (await client.post(url, headers=ALICE, json={"rating": "up"})).status_code == 204
        assert (await tree(client, conversation_id))[1]["feedback"]["rating"] == "up"
        down = {"rating": "down", "reason": "inaccurate", "comment": "not a colour"}
        assert (await client.post(url, headers=ALICE, json=down)).status_code == 204
        feedback = (await tree(client, conversation_id))[1]["feedback"]
        assert {key: feedback[key] for key in down} == down and feedback["rated_at"].endswith("Z")

        theirs = await client.post(url, headers=BOB, json={"rating": "up"})
        assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "message_not_found", theirs.text
        own_question = await client.post(f"/v1/messages/{question['id']}/feedback", headers=ALICE, json={"rating": "up"})
        assert own_question.status_code == 400, own_question.text
        bad = await client.post(url, headers=ALICE, json={"rating": "meh"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "rating", bad.text
        assert (await tree(client, conversation_id))[1]["feedback"]["rating"] == "down", "a refused rating changed the stored one"

        after = await scrape(client, product_stack.chat_ops_url)
        assert grew(before, after, "tandem_feedback_total", vote="up", **labels) == 1
        assert grew(before, after, "tandem_feedback_total", vote="down", **labels) == 1


async def test_a_regeneration_counts_against_the_version_of_the_answer_it_replaces(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        conversation_id = (await client.post("/v1/conversations", headers=ALICE, json={})).json()["id"]
        before = await scrape(client, product_stack.chat_ops_url)
        answer_id = await answered(client, conversation_id, "Name a fruit.")
        model = (await final(client, conversation_id, answer_id))["model"]
        labels = {"model": model.partition("@")[0], "version": model.partition("@")[2]}
        async with client.stream(
            "POST", f"/v1/messages/{answer_id}/regenerate", headers={**ALICE, "Accept": "text/event-stream"}, json=GREEDY
        ) as response:
            again = await read_stream(response)
        assert again[-1].event == "done", again
        await final(client, conversation_id, again[0].data["message_id"])
        after = await scrape(client, product_stack.chat_ops_url)
        assert grew(before, after, "tandem_regenerations_total", **labels) == 1
        assert grew(before, after, "tandem_answers_total", **labels) == 2, "the first answer and its regeneration"
