"""The usage ledger on the whole stack: a product-API message and an OpenAI completion from one
user are both counted, with the tokens their replies reported (the `done` event's usage and
OpenAI's `usage`), under the model that answered, in `GET /v1/usage` on either chat instance and
in `tandem usage export`; a request without a key gets 401, a `since` too far back 400.

Carol sends only here, so her ledger holds these two replies and nothing else. The relay records
a reply once its log closes, a moment after the client read its last event: the test waits for
the count (the reply's usage, or nothing, never a partial figure)."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from helpers import wait_until
from product_stack import CAROL, read_stream

from tandem.store.usage import today_utc

pytestmark = pytest.mark.real_model
REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"


async def product_message(client: httpx.AsyncClient) -> tuple[str, dict[str, int]]:
    """(the model that answered, the done event's usage) of one message in a new conversation."""
    conversation = await client.post("/v1/conversations", headers=CAROL, json={})
    assert conversation.status_code == 201, conversation.text
    url = f"/v1/conversations/{conversation.json()['id']}/messages"
    body = {"content": QUESTION, "temperature": 0, "max_tokens": 12}
    async with client.stream("POST", url, headers={**CAROL, "Accept": "text/event-stream"}, json=body) as response:
        events = await read_stream(response)
    meta = next(e.data for e in events if e.event == "meta")
    assert events[-1].event == "done", events[-1]
    return meta["model"], events[-1].data["usage"]


async def openai_completion(client: httpx.AsyncClient) -> tuple[str, dict[str, int]]:
    """(its model, its usage as the product API names the fields) of one chat completion."""
    models = await client.get("/v1/models", headers=CAROL)
    body = {"model": models.json()["data"][0]["id"], "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 9}
    response = await client.post("/v1/chat/completions", headers=CAROL, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    usage = answer["usage"]
    return answer["model"], {
        "input": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "output": usage["completion_tokens"],
    }


def expected_rows(replies: list[tuple[str, dict[str, int]]]) -> dict[str, tuple[int, int, int, int]]:
    """model -> (messages, prompt, cached, completion) summed over the replies."""
    rows: dict[str, tuple[int, int, int, int]] = {}
    for model, usage in replies:
        n, p, c, o = rows.get(model, (0, 0, 0, 0))
        rows[model] = (n + 1, p + usage["input"], c + usage["cached"], o + usage["output"])
    return rows


def summed(rows: list[dict]) -> dict[str, tuple[int, int, int, int]]:
    """The ledger's rows summed per model over days (the two replies may straddle a UTC midnight)."""
    by_model: dict[str, tuple[int, int, int, int]] = {}
    for row in rows:
        n, p, c, o = by_model.get(row["model"], (0, 0, 0, 0))
        by_model[row["model"]] = (
            n + int(row["messages"]),
            p + int(row["prompt_tokens"]),
            c + int(row["cached_tokens"]),
            o + int(row["completion_tokens"]),
        )
    return by_model


async def test_usage_counts_the_tokens_of_a_product_message_and_an_openai_completion(product_stack):
    since = (today_utc() - timedelta(days=1)).isoformat()
    async with (
        httpx.AsyncClient(base_url=product_stack.chat_urls[0], timeout=120) as first,
        httpx.AsyncClient(base_url=product_stack.chat_urls[1], timeout=120) as second,
    ):
        replies = [await product_message(first), await openai_completion(second)]
        assert all(usage["input"] > 5 and usage["output"] > 0 for _, usage in replies), replies
        expected = expected_rows(replies)

        async def counted() -> list[dict] | None:
            response = await second.get("/v1/usage", headers=CAROL, params={"since": since})
            assert response.status_code == 200, response.text
            rows = response.json()["data"]
            return rows if sum(row["messages"] for row in rows) >= 2 else None

        rows = await wait_until(counted)
        assert summed(rows) == expected
        assert {row["day"] for row in rows} <= {since, today_utc().isoformat()}
        assert (await first.get("/v1/usage", headers=CAROL, params={"since": since})).json()["data"] == rows
        assert (await first.get("/v1/usage")).status_code == 401
        too_old = (today_utc() - timedelta(days=1000)).isoformat()
        refused = await first.get("/v1/usage", headers=CAROL, params={"since": too_old})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "since"

    env = {
        **os.environ,
        "TANDEM_STORE": "sqlite",
        "TANDEM_SQLITE_PATH": str(product_stack.store_path),
        "TANDEM_CONFIG": "/nonexistent.toml",
    }
    exported = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "usage", "export", "--since", since, "--format", "csv"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert exported.returncode == 0, exported.stderr
    carols = [row for row in csv.DictReader(io.StringIO(exported.stdout)) if row["user_id"] == "carol"]
    assert summed(carols) == expected
