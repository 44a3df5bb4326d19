"""The serving metrics on a live stack (the session's product stack): after chat messages, chat's
/metrics shows the TTFT, inter-token and end-to-end latency of the replies as their client got them,
and the decode worker's shows its KV cache in use while a reply runs and its prefix cache's queries
and hits, under the documented names; the router counts the message's placement and queue wait and
the relays the token events they logged. Every metric the Grafana dashboard queries is exported."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path

import httpx
import nats
import pytest
from helpers import next_heartbeat, wait_until
from product_stack import ALICE, ProductStack, read_stream
from prometheus_client.parser import text_string_to_metric_families
from scraped_metrics import grew, scrape, total

pytestmark = pytest.mark.real_model
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "tandem.json"
STORY = {"temperature": 0, "max_tokens": 24}
POLL_S = 0.05  # between scrapes while a reply runs: a tighter loop would slow the worker it watches


async def http_urls(stack: ProductStack) -> dict[str, list[str]]:
    """Each instance's /metrics base URL, from its heartbeat."""
    nc = await nats.connect(stack.nats_url)
    try:
        urls: dict[str, list[str]] = {}
        for role, instance_ids in stack.ids.items():
            for instance_id in instance_ids:
                heartbeat = await next_heartbeat(nc, role, instance_id, timeout_s=10)
                service = heartbeat.service if role in ("decode", "prefill") else heartbeat
                urls.setdefault(role, []).append(service.http_url)
        return urls
    finally:
        await nc.close()


async def send(client: httpx.AsyncClient, conversation_id: str, content: str) -> list:
    async with client.stream(
        "POST",
        f"/v1/conversations/{conversation_id}/messages",
        headers={**ALICE, "Accept": "text/event-stream"},
        json={"content": content, **STORY},
    ) as response:
        return await read_stream(response)


async def peak_kv_usage(client: httpx.AsyncClient, decode_url: str, done: asyncio.Event) -> float:
    """The highest KV usage the decode worker reports while `done` is not set."""
    peak = 0.0
    while not done.is_set():
        samples = await scrape(client, decode_url)
        peak = max(peak, total(samples, "tandem_worker_kv_cache_usage_ratio", role="decode"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), POLL_S)
    return peak


async def test_after_chat_messages_chat_and_the_decode_worker_show_latency_kv_usage_and_prefix_cache_figures(product_stack):
    urls = await http_urls(product_stack)
    chat_url, decode_url = product_stack.url, urls["decode"][0]
    async with httpx.AsyncClient(base_url=chat_url, timeout=60) as client:
        chat_before, decode_before = await scrape(client, product_stack.chat_ops_url), await scrape(client, decode_url)
        conversation = (await client.post("/v1/conversations", headers=ALICE, json={})).json()["id"]
        done = asyncio.Event()
        watching = asyncio.create_task(peak_kv_usage(client, decode_url, done))
        try:
            first = await send(client, conversation, "Tell me a long story about a lighthouse keeper and a storm.")
        finally:
            done.set()
        peak = await watching
        second = await send(client, conversation, "And what happened the next morning?")
        chat_after, decode_after = await scrape(client, product_stack.chat_ops_url), await scrape(client, decode_url)

    assert first[-1].event == "done" and second[-1].event == "done", (first[-1], second[-1])
    model = first[0].data["model"]
    num_deltas = sum(1 for event in first + second if event.event == "delta" and event.data["text"])

    labels = {"tier": "plus", "model": model}
    assert num_deltas >= 4, "both replies streamed content"
    assert grew(chat_before, chat_after, "tandem_chat_time_to_first_token_seconds_count", **labels) >= 2
    assert grew(chat_before, chat_after, "tandem_chat_time_to_first_token_seconds_sum", **labels) > 0
    assert grew(chat_before, chat_after, "tandem_chat_inter_token_latency_seconds_count", **labels) > 0
    assert grew(chat_before, chat_after, "tandem_chat_inter_token_latency_seconds_sum", **labels) > 0
    assert grew(chat_before, chat_after, "tandem_chat_e2e_latency_seconds_count", **labels) >= 2
    assert grew(chat_before, chat_after, "tandem_chat_replies_total", outcome="done", **labels) >= 2
    output_tokens = sum(e.data["usage"]["output"] for e in (first[-1], second[-1]))
    assert grew(chat_before, chat_after, "tandem_chat_output_tokens_total", **labels) >= output_tokens

    worker = {"role": "decode", "model": model}
    assert 0 < peak <= 1, "the KV cache is in use while a reply runs"
    queries = grew(decode_before, decode_after, "tandem_worker_prefix_cache_queries_tokens_total", **worker)
    hits = grew(decode_before, decode_after, "tandem_worker_prefix_cache_hits_tokens_total", **worker)
    prompt_tokens = sum(e.data["usage"]["input"] for e in (first[-1], second[-1]))
    assert queries >= prompt_tokens, "each prompt is looked up when admitted"
    assert hits >= 16, "the second turn finds the first turn's blocks"
    assert grew(decode_before, decode_after, "tandem_worker_generation_tokens_total", **worker) >= output_tokens
    assert grew(decode_before, decode_after, "tandem_worker_step_seconds_count", **worker) > 0
    cached = total(decode_after, "tandem_worker_kv_cache_prefix_cached_ratio", **worker)
    assert 0 < cached <= 1, "the replies' prefixes stay cached after they end"


PLACEMENT_REASONS = {"cache_hit", "load", "rendezvous", "lane", "only_worker"}  # docs/operations.md, "Metrics"


async def test_a_chat_message_counts_its_placement_and_queue_wait_on_the_router_and_its_events_on_the_relays(product_stack):
    urls = await http_urls(product_stack)
    router_url, relay_urls = urls["router"][0], urls["relay"]
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=60) as client:
        router_before = await scrape(client, router_url)
        relays_before = [await scrape(client, url) for url in relay_urls]
        conversation = (await client.post("/v1/conversations", headers=ALICE, json={})).json()["id"]
        events = await send(client, conversation, "Name three colours.")
        assert events[-1].event == "done", events[-1]
        num_deltas = sum(1 for event in events if event.event == "delta")
        assert num_deltas >= 1
        router_after = await scrape(client, router_url)

        async def relays_logged() -> bool:
            # Each delta came from a token event of its own (a final event's text is one more delta
            # at most), logged by one of the two relays; a relay counts an event just after its
            # append, which a reader may see first: polled until they add up.
            scrapes = [await scrape(client, url) for url in relay_urls]
            logged = sum(
                grew(before, after, "tandem_relay_events_logged_total") for before, after in zip(relays_before, scrapes, strict=True)
            )
            return logged >= num_deltas

        await wait_until(relays_logged, timeout_s=10)

    assert grew(router_before, router_after, "tandem_router_placements_total", role="decode") >= 1
    placed_for = {
        dict(labels)["reason"]
        for (name, labels), value in router_after.items()
        if name == "tandem_router_placements_total" and value > router_before.get((name, labels), 0)
    }
    assert placed_for and placed_for <= PLACEMENT_REASONS, placed_for
    assert grew(router_before, router_after, "tandem_router_queue_wait_seconds_count", lane="paid") >= 1, "alice is on plus: paid"
    assert grew(router_before, router_after, "tandem_router_dispatch_seconds_count") >= 1


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert exprs, "the dashboard queries nothing"
    names = {name for expr in exprs for name in re.findall(r"\btandem_[a-z0-9_]+", expr)}
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}


async def test_every_metric_the_dashboard_queries_is_exported_by_the_live_stack(product_stack):
    urls = await http_urls(product_stack)
    exported: set[str] = set()
    async with httpx.AsyncClient(timeout=30) as client:
        for base_url in (url for role_urls in urls.values() for url in role_urls):
            response = await client.get(f"{base_url}/metrics")
            assert response.status_code == 200, (base_url, response.status_code)
            for family in text_string_to_metric_families(response.text):
                exported.add(family.name)
                if family.type == "counter":
                    exported.add(f"{family.name}_total")
    queried = dashboard_metric_names()
    assert len(queried) > 15
    missing = sorted(queried - exported)
    # A prefill worker's metrics are a decode worker's too (one module): the stack without a
    # prefill worker still exports every name.
    assert not missing, f"the dashboard queries metrics no service exports: {missing}"


async def test_openai_replies_count_streamed_ttft_and_every_reply_s_e2e(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=60) as client:
        model = (await client.get("/v1/models", headers=ALICE)).json()["data"][0]["id"]
        labels = {"tier": "plus", "model": model}
        request = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8, "temperature": 0}
        before = await scrape(client, product_stack.chat_ops_url)
        whole = await client.post("/v1/chat/completions", headers=ALICE, json=request)
        assert whole.status_code == 200, whole.text
        async with client.stream("POST", "/v1/chat/completions", headers=ALICE, json={**request, "stream": True}) as streamed:
            chunks = [line async for line in streamed.aiter_lines() if line.startswith("data:")]
        after = await scrape(client, product_stack.chat_ops_url)
    assert chunks[-1] == "data: [DONE]"

    assert grew(before, after, "tandem_chat_e2e_latency_seconds_count", **labels) >= 2, "whole and streamed"
    assert grew(before, after, "tandem_chat_time_to_first_token_seconds_count", **labels) >= 1, "the streamed one"
    assert grew(before, after, "tandem_chat_replies_total", outcome="done", **labels) >= 2
    assert grew(before, after, "tandem_chat_prompt_tokens_total", **labels) >= 2 * whole.json()["usage"]["prompt_tokens"]
