"""Conversation summaries against the whole stack as processes (the lean stack of
tests/e2e/conftest.py, whose free tier may send prompts of 300 tokens): a free user's
conversation that outgrows that budget gets a summary of the turns that fell out, written in the background on the background lane; the
conversation view shows it (and no extra message); and the next turn's prompt, as sent to the
router and kept in its reply's token-log record, carries the summary in place of those turns."""

from __future__ import annotations

import httpx
import pytest
import redis.asyncio as aioredis
from helpers import wait_until
from product_stack import BOB, LEAN_PROMPT_BUDGET_FREE, ProductStack, read_stream

from tandem.models.loader import load_tokenizer
from tandem.tokenlog import load_reply
from tandem.v1.generate_pb2 import GenerateRequest

pytestmark = pytest.mark.real_model
MAX_TURNS = 8  # the conversation outgrows the budget well before
SUMMARY_WAIT_S = 120  # a summary of 40 tokens on the CPU, on a lane that waits for idle capacity


@pytest.fixture
def summary_stack(lean_stack: ProductStack) -> ProductStack:
    return lean_stack


def question(number: int) -> str:
    """A message of about 45 tokens that names its turn (so a prompt shows which turns it holds)."""
    return (
        f"Turn {number}: my name is Ada, I live in Paris and I keep bees on my roof. "
        f"Please give me one short fact about the number {number * 7}, and say it in one sentence only."
    )


async def send(client: httpx.AsyncClient, conversation_id: str, content: str) -> dict:
    """The reply's meta event (message_id, dropped_turns) once the reply has ended."""
    async with client.stream(
        "POST",
        f"/v1/conversations/{conversation_id}/messages",
        headers={**BOB, "Accept": "text/event-stream"},
        json={"content": content, "temperature": 0},
    ) as response:
        events = await read_stream(response)
    assert events[-1].event == "done", events[-1]
    return events[0].data


async def prompt_of(redis: aioredis.Redis, reply_id: str) -> str:
    meta = await load_reply(redis, reply_id)
    assert meta is not None, f"reply {reply_id} has no log record"
    return load_tokenizer(None).decode(GenerateRequest.FromString(meta.request).prompt_token_ids)


async def test_a_conversation_longer_than_the_free_budget_gets_a_summary_that_the_next_prompt_carries(summary_stack):
    redis = aioredis.from_url(summary_stack.redis_url)
    async with httpx.AsyncClient(base_url=summary_stack.url, timeout=120) as client:
        created = await client.post("/v1/conversations", headers=BOB, json={})
        conversation_id = created.json()["id"]
        view = f"/v1/conversations/{conversation_id}"
        assert (await client.get(view, headers=BOB)).json()["summary"] is None, "no summary before any turn falls out"

        num_turns = 0
        for number in range(1, MAX_TURNS + 1):
            meta = await send(client, conversation_id, question(number))
            num_turns = number
            if meta["dropped_turns"] > 0:
                break
        assert meta["dropped_turns"] > 0, f"{MAX_TURNS} turns never outgrew a free prompt of {LEAN_PROMPT_BUDGET_FREE} tokens"
        dropped_prompt = await prompt_of(redis, meta["message_id"])
        assert question(1) not in dropped_prompt, "the oldest turn fell out of the prompt"

        async def summarised() -> dict | None:
            return (await client.get(view, headers=BOB)).json()["summary"]

        try:
            summary = await wait_until(summarised, timeout_s=SUMMARY_WAIT_S, interval_s=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the stack's logs:\n{summary_stack.logs(60)}") from None
        assert summary["text"].strip() and summary["upto_seq"] >= 1
        shown = (await client.get(view, headers=BOB)).json()
        # The summary's own reply is no message of the conversation: the messages are the turns,
        # each question and its answer. (Not "no message has the summary's text": greedy
        # SmolLM2-135M may summarise one answer by repeating it.)
        assert len(shown["messages"]) == 2 * num_turns, "the summary's own reply is no message of the conversation"
        assert [m["role"] for m in shown["messages"]] == ["user", "assistant"] * num_turns
        assert [m["content"] for m in shown["messages"][::2]] == [question(n) for n in range(1, num_turns + 1)]
        covered = [m for m in shown["messages"] if m["seq"] <= summary["upto_seq"]]
        assert covered and covered[0]["content"] == question(1), "it covers the oldest turns, from the first"

        after = await send(client, conversation_id, question(num_turns + 1))
        prompt = await prompt_of(redis, after["message_id"])
        assert summary["text"] in prompt, "the next turn's prompt carries the summary"
        assert question(1) not in prompt
        assert prompt.index(summary["text"]) < prompt.index(question(num_turns + 1))

        metrics = (await client.get(f"{summary_stack.chat_ops_url}/metrics")).text
        assert 'tandem_chat_summaries_total{outcome="written"}' in metrics
    await redis.aclose()
