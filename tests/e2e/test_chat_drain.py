"""A chat instance stopped (SIGTERM, as in a rolling upgrade) while it streams a reply: it ends
the stream at once, before the server waits for its open requests, so the client resumes on
another instance with Last-Event-ID and loses nothing; no request is cut at the grace's end."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from product_stack import ALICE, SseReader, own_product_stack, read_stream, text_of

pytestmark = pytest.mark.real_model
ROLES = ("router", "decode", "relay", "chat", "chat")


async def test_a_chat_instance_stopped_mid_reply_ends_the_stream_and_the_client_resumes_on_another(tmp_path):
    async with own_product_stack(tmp_path, roles=ROLES) as stack:
        first_chat = next(c for c in stack.children if c.name == "chat")
        async with (
            httpx.AsyncClient(base_url=stack.chat_urls[0], timeout=120) as stopping,
            httpx.AsyncClient(base_url=stack.chat_urls[1], timeout=120) as other,
        ):
            created = await stopping.post("/v1/conversations", headers=ALICE, json={})
            conversation_id = created.json()["id"]
            body = {"content": "Write a long story about a lighthouse keeper.", "temperature": 0, "max_tokens": 160}
            url = f"/v1/conversations/{conversation_id}/messages"
            async with stopping.stream("POST", url, headers={**ALICE, "Accept": "text/event-stream"}, json=body) as response:
                reader = SseReader(response)
                head = await reader.read(stop_after=4)
                first_chat.process.send_signal(signal.SIGTERM)
                rest_here = await reader.read()  # the server ends it (a cut would raise here)
            assert all(e.event not in ("done", "error") for e in rest_here), "it ended before the reply did"
            assert await asyncio.wait_for(first_chat.wait_async(), 30) == 0
            output = first_chat.recent_output(400)
            assert "ASGI callable returned without" not in output, output
            seen = head + rest_here
            message_id = head[0].data["message_id"]
            async with other.stream(
                "GET", f"/v1/messages/{message_id}/stream", headers={**ALICE, "Last-Event-ID": str(seen[-1].id)}
            ) as resumed:
                tail = await read_stream(resumed)
    events = seen + tail
    assert [e.id for e in events] == list(range(1, len(events) + 1)), "contiguous across the two instances"
    assert events[-1].event == "done" and events[-1].data["usage"]["output"] > 20
    assert len(text_of(events)) > 0
