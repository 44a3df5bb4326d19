"""A stack whose prefill and decode workers are tensor-parallel groups of three ranks each (SmolLM2:
9 heads, 3 KV heads, one a rank), every part a real process: the OpenAI and chat endpoints answer,
and a long prompt is prefilled by the prefill group and handed to the decode group rank to rank
(each rank's heads of every block, over UCXX), counted on both sides. In float32, where three ranks
answer as one does (tests/integration/test_tensor_parallel.py): the answer is the one-rank
in-process engine's, word for word (SmolLM2's own, which is not always right)."""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio
import torch
from product_stack import ALICE, own_product_stack, read_stream, text_of
from scraped_metrics import grew, scrape

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.models.loader import load_model

pytestmark = pytest.mark.real_model
ROLES = ("router", "prefill", "decode", "relay", "chat")
HANDOFFS = "tandem_worker_kv_handoffs_total"
FILLER = " ".join(["The river runs past the old mill and the market square."] * 12)  # well past the remote-prefill threshold


@pytest_asyncio.fixture(scope="module")
async def tp_stack(tmp_path_factory):
    settings = {
        "TANDEM_TENSOR_PARALLEL_SIZE": "3",
        "TANDEM_DTYPE": "fp32",
        "TANDEM_TORCH_THREADS": "1",
        "TANDEM_REMOTE_PREFILL_MIN_TOKENS": "96",
        "TANDEM_MAX_ANSWER_TOKENS": "16",
    }
    async with own_product_stack(tmp_path_factory.mktemp("tp-stack"), roles=ROLES, **settings) as stack:
        yield stack


def one_rank_answer(question: str, max_tokens: int) -> str:
    """What the in-process engine, one rank in float32, answers to `question` alone."""
    loaded = load_model(None, torch.float32, "cpu", select_attention("cpu"))
    prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": question}])
    stream = Engine(loaded, EngineConfig(num_kv_blocks=64)).generate([Request("x", tuple(prompt), SamplingOptions(max_tokens=max_tokens))])
    return "".join(output.text for output in stream["x"])


async def test_a_long_prompt_goes_from_the_prefill_group_to_the_decode_group_and_is_answered(tp_stack):
    prefill, decode = tp_stack.ops_urls[tp_stack.ids["prefill"][0]], tp_stack.ops_urls[tp_stack.ids["decode"][0]]
    async with httpx.AsyncClient(base_url=tp_stack.url, timeout=180) as client:
        model = (await client.get("/v1/models", headers=ALICE)).json()["data"][0]["id"]
        sent, received = await scrape(client, prefill), await scrape(client, decode)
        question = f"{FILLER}\n\nWhat is the capital of France?"
        body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 16}
        response = await client.post("/v1/chat/completions", headers=ALICE, json=body)
        assert response.status_code == 200, response.text + tp_stack.logs()
        answer = response.json()
        assert answer["choices"][0]["message"]["content"] == one_rank_answer(question, 16), answer
        assert answer["usage"]["prompt_tokens"] > 96
        assert grew(sent, await scrape(client, prefill), HANDOFFS, side="send", outcome="ok") == 1
        assert grew(received, await scrape(client, decode), HANDOFFS, side="receive", outcome="ok") == 1


async def test_the_chat_endpoint_streams_an_answer_from_the_decode_group(tp_stack):
    async with httpx.AsyncClient(base_url=tp_stack.url, timeout=180) as client:
        created = await client.post("/v1/conversations", headers=ALICE, json={})
        assert created.status_code == 201, created.text
        async with client.stream(
            "POST",
            f"/v1/conversations/{created.json()['id']}/messages",
            headers={**ALICE, "Accept": "text/event-stream"},
            json={"content": "What is the capital of France?", "temperature": 0},
        ) as response:
            events = await read_stream(response)
        assert events[0].event == "meta" and events[-1].event == "done", events
        assert "Paris" in text_of(events)
