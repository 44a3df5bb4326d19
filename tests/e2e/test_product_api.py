"""The product API over HTTP/SSE against the whole stack as processes: conversations of several
turns, resume with Last-Event-ID on either chat instance, stop, the idle cancel, idempotency,
auth, and input checks."""

from __future__ import annotations

import random
import uuid

import httpx
import nats
import pytest
import redis.asyncio as aioredis
from helpers import next_heartbeat, service_env, service_process, wait_until
from product_stack import ALICE, BOB, SseReader, read_stream, text_of

from tandem.models.loader import load_tokenizer
from tandem.tokenlog import load_reply
from tandem.v1.generate_pb2 import GenerateRequest

pytestmark = pytest.mark.real_model
GREEDY = {"temperature": 0, "max_tokens": 24}


async def new_conversation(client: httpx.AsyncClient, headers=ALICE) -> str:
    response = await client.post("/v1/conversations", headers=headers, json={})
    assert response.status_code == 201, response.text
    return response.json()["id"]


async def send(client: httpx.AsyncClient, conversation_id: str, content: str, headers=ALICE, stop_after=None, **body):
    async with client.stream(
        "POST",
        f"/v1/conversations/{conversation_id}/messages",
        headers={**headers, "Accept": "text/event-stream"},
        json={"content": content, **GREEDY, **body},
    ) as response:
        return await read_stream(response, stop_after)


def long_reply(client: httpx.AsyncClient, conversation_id: str, content: str):
    """The streaming response of a message whose answer runs long (up to 400 tokens)."""
    return client.stream(
        "POST",
        f"/v1/conversations/{conversation_id}/messages",
        headers={**ALICE, "Accept": "text/event-stream"},
        json={"content": content, "temperature": 0, "max_tokens": 400},
    )


async def resume(client: httpx.AsyncClient, message_id: str, last_event_id: int, headers=ALICE):
    async with client.stream(
        "GET", f"/v1/messages/{message_id}/stream", headers={**headers, "Last-Event-ID": str(last_event_id)}
    ) as response:
        return await read_stream(response)


async def stored(client: httpx.AsyncClient, conversation_id: str, headers=ALICE) -> dict:
    response = await client.get(f"/v1/conversations/{conversation_id}", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


async def finished(client, conversation_id: str, message_id: str) -> dict:
    """The stored message once the relay has saved its final state."""

    async def check():
        messages = {m["id"]: m for m in (await stored(client, conversation_id))["messages"]}
        message = messages.get(message_id)
        return message if message and message["status"] != "running" else None

    return await wait_until(check)


async def test_a_three_turn_conversation_streams_is_stored_and_carries_its_history(product_stack):
    tokenizer = load_tokenizer(None)
    redis = aioredis.from_url(product_stack.redis_url)
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        conversation_id = await new_conversation(client)
        questions = ["What is the capital of France?", "And of Italy?", "Which of the two is further north?"]
        replies = []
        for question in questions:
            events = await send(client, conversation_id, question)
            assert [e.event for e in events][0] == "meta" and events[-1].event == "done", events
            assert [e.id for e in events] == list(range(1, len(events) + 1))
            replies.append((events[0].data["message_id"], text_of(events), events[-1].data["usage"]))
        assert "Paris" in replies[0][1]
        for _, _, usage in replies[1:]:
            assert usage["cached"] > 0, "a follow-up turn finds the earlier turns in the prefix cache"
        conversation = await stored(client, conversation_id)
        assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"] * 3
        assert conversation["title"].startswith("What is the capital")
        for (message_id, text, usage), answer in zip(replies, conversation["messages"][1::2]):
            assert (answer["id"], answer["content"], answer["status"]) == (message_id, text, "complete")
            assert answer["tokens"] == usage["output"]
        third = await load_reply(redis, replies[2][0])
        prompt = tokenizer.decode(GenerateRequest.FromString(third.request).prompt_token_ids)
        assert questions[0] in prompt and questions[1] in prompt and replies[0][1].strip() in prompt
        listed = (await client.get("/v1/conversations", headers=ALICE)).json()["conversations"]
        assert listed[0]["id"] == conversation_id, "the conversation just written is the newest"
    await redis.aclose()


async def test_a_dropped_stream_resumes_with_last_event_id_on_either_instance(product_stack):
    rng = random.Random(2026)
    clients = [httpx.AsyncClient(base_url=url, timeout=120) for url in product_stack.chat_urls]
    prompt = "Name three colours of the rainbow."
    reference = await send(clients[0], await new_conversation(clients[0]), prompt)
    assert reference[-1].event == "done"
    for run in range(20):
        first, second = rng.choice(clients), rng.choice(clients)
        conversation_id = await new_conversation(first)
        drop_after = rng.randint(1, len(reference) - 1)
        head = await send(first, conversation_id, prompt, stop_after=drop_after)
        assert len(head) == drop_after
        tail = await resume(second, head[0].data["message_id"], head[-1].id)
        events = head + tail
        assert [e.id for e in events] == list(range(1, len(events) + 1)), f"run {run}: ids not contiguous"
        assert text_of(events) == text_of(reference), f"run {run}: dropped after {drop_after} events"
        assert events[-1].event == "done"
    for client in clients:
        await client.aclose()


async def test_stop_mid_reply_keeps_the_streamed_text_as_stopped_and_frees_the_kv(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        conversation_id = await new_conversation(client)
        async with long_reply(client, conversation_id, "Write a long story about a lighthouse keeper.") as response:
            reader = SseReader(response)
            head = await reader.read(stop_after=4)
            message_id = head[0].data["message_id"]
            stop = await client.post(f"/v1/messages/{message_id}/stop", headers=ALICE)
            assert stop.status_code == 200 and stop.json()["status"] == "stopping"
            rest = await reader.read()
        events = head + rest
        assert events[-1].event == "done" and events[-1].data["finish"] == "cancelled"
        assert events[-1].data["usage"]["output"] < 400
        message = await finished(client, conversation_id, message_id)
        assert message["status"] == "stopped"
        assert message["content"] == text_of(events)
    decode_id = product_stack.ids["decode"][0]
    nc = await nats.connect(product_stack.nats_url)
    await next_heartbeat(nc, "decode", decode_id, timeout_s=30)  # one that may predate the cancel
    heartbeat = await next_heartbeat(nc, "decode", decode_id, timeout_s=30)
    await nc.close()
    assert heartbeat.kv_blocks_free == heartbeat.kv_blocks_total


async def test_a_reply_nobody_reads_is_cancelled_and_stored_as_stopped(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        conversation_id = await new_conversation(client)
        prompt = "Write a long story about a lighthouse keeper and the ships he guides."  # runs far past the idle timeout
        head = await send(client, conversation_id, prompt, stop_after=2, max_tokens=1000)
        message_id = head[0].data["message_id"]
        # Nobody reads now: the relay cancels it after the stack's short idle timeout (product_stack.py).
        message = await finished(client, conversation_id, message_id)
        assert message["status"] == "stopped"
        tail = await resume(client, message_id, head[-1].id)
        assert tail[-1].event == "done" and tail[-1].data["finish"] == "cancelled"
        assert tail[-1].data["usage"]["output"] < 1000
        assert message["content"] == text_of(head + tail)


async def test_the_same_idempotency_key_twice_gives_one_generation_and_identical_streams(product_stack):
    key = str(uuid.uuid4())
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        conversation_id = await new_conversation(client)
        headers = {**ALICE, "Idempotency-Key": key}
        first = await send(client, conversation_id, "Say hello.", headers=headers)
        second = await send(client, conversation_id, "Say hello.", headers=headers)
        assert first[0].data["message_id"] == second[0].data["message_id"]
        assert [(e.id, e.event, e.data) for e in first] == [(e.id, e.event, e.data) for e in second]
        conversation = await stored(client, conversation_id)
        assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]


async def test_regenerate_answers_the_same_user_turn_again(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        conversation_id = await new_conversation(client)
        first = await send(client, conversation_id, "Give me a name for a cat.")
        old_id = first[0].data["message_id"]
        await finished(client, conversation_id, old_id)
        async with client.stream(
            "POST",
            f"/v1/messages/{old_id}/regenerate",
            headers={**ALICE, "Accept": "text/event-stream"},
            json={"temperature": 1.0, "seed": 7, "max_tokens": 24},
        ) as response:
            again = await read_stream(response)
        new_id = again[0].data["message_id"]
        assert new_id != old_id and again[-1].event == "done"
        assert again[-1].data["usage"]["cached"] > 0, "the prompt up to the user turn is cached"
        message = await finished(client, conversation_id, new_id)
        conversation = await stored(client, conversation_id)
        assert [m["id"] for m in conversation["messages"]] == [conversation["messages"][0]["id"], new_id]
        assert message["content"] == text_of(again)


async def test_auth_and_ownership(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=30) as client:
        assert (await client.get("/v1/conversations")).status_code == 401
        assert (await client.get("/v1/conversations", headers={"Authorization": "Bearer nope"})).status_code == 401
        conversation_id = await new_conversation(client, ALICE)
        assert (await client.get(f"/v1/conversations/{conversation_id}", headers=BOB)).status_code == 404
        response = await client.post(f"/v1/conversations/{conversation_id}/messages", headers=BOB, json={"content": "hi"})
        assert response.status_code == 404
        assert conversation_id not in [c["id"] for c in (await client.get("/v1/conversations", headers=BOB)).json()["conversations"]]


async def test_empty_and_oversize_messages_are_refused_with_the_reason(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=30) as client:
        conversation_id = await new_conversation(client)
        empty = await client.post(f"/v1/conversations/{conversation_id}/messages", headers=ALICE, json={"content": "  "})
        assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
        huge = "x1 " * 10000  # under the character limit, but more tokens than the model's window
        too_long = await client.post(f"/v1/conversations/{conversation_id}/messages", headers=ALICE, json={"content": huge})
        assert too_long.status_code == 413, too_long.text
        message = too_long.json()["error"]["message"]
        assert "tokens" in message and any(ch.isdigit() for ch in message)
        too_many_chars = await client.post(f"/v1/conversations/{conversation_id}/messages", headers=ALICE, json={"content": "a" * 40000})
        assert too_many_chars.status_code == 413 and "characters" in too_many_chars.json()["error"]["message"]
        assert (await stored(client, conversation_id))["messages"] == [], "a refused message is not stored"


async def test_a_new_message_cancels_the_reply_still_running_in_its_conversation(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        conversation_id = await new_conversation(client)
        async with long_reply(client, conversation_id, "Write a long story about a fox.") as response:
            reader = SseReader(response)
            head = await reader.read(stop_after=3)
            second = await send(client, conversation_id, "Never mind: what is 2 + 2?")
            rest = await reader.read()
        assert rest[-1].event == "done" and rest[-1].data["finish"] == "cancelled"
        assert second[-1].event == "done" and second[-1].data["finish"] in ("stop", "length")
        first = await finished(client, conversation_id, head[0].data["message_id"])
        assert first["status"] == "stopped"


async def test_a_conversation_is_renamed_by_its_owner_only(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=30) as client:
        conversation_id = await new_conversation(client)
        path = f"/v1/conversations/{conversation_id}"
        assert (await client.patch(path, headers=BOB, json={"title": "Bob's now"})).status_code == 404
        renamed = await client.patch(path, headers=ALICE, json={"title": "  Trip to Lisbon  "})
        assert renamed.status_code == 200, renamed.text
        assert (renamed.json()["id"], renamed.json()["title"]) == (conversation_id, "Trip to Lisbon")
        assert (await stored(client, conversation_id))["title"] == "Trip to Lisbon"
        listed = (await client.get("/v1/conversations", headers=ALICE)).json()["conversations"]
        assert {c["id"]: c["title"] for c in listed}[conversation_id] == "Trip to Lisbon"
        for bad in ({"title": "   "}, {"title": "x" * 201}, {}):
            refused = await client.patch(path, headers=ALICE, json=bad)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "title", (bad, refused.text)
        assert (await stored(client, conversation_id))["title"] == "Trip to Lisbon"
        assert (await client.patch("/v1/conversations/nope", headers=ALICE, json={"title": "t"})).status_code == 404


async def test_deleting_a_conversation_mid_reply_cancels_the_reply_and_removes_everything(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        conversation_id = await new_conversation(client)
        path = f"/v1/conversations/{conversation_id}"
        async with long_reply(client, conversation_id, "Write a long story about a lighthouse keeper.") as response:
            reader = SseReader(response)
            head = await reader.read(stop_after=3)
            message_id = head[0].data["message_id"]
            assert (await client.delete(path, headers=BOB)).status_code == 404
            assert (await client.get(path, headers=ALICE)).status_code == 200, "another user's delete removed it"
            deleted = await client.delete(path, headers=ALICE)
            assert deleted.status_code == 204, deleted.text
            rest = await reader.read()
        assert rest[-1].event == "done" and rest[-1].data["finish"] == "cancelled"
        assert rest[-1].data["usage"]["output"] < 400
    decode_id = product_stack.ids["decode"][0]
    nc = await nats.connect(product_stack.nats_url)
    await next_heartbeat(nc, "decode", decode_id, timeout_s=30)  # one that may predate the cancel
    heartbeat = await next_heartbeat(nc, "decode", decode_id, timeout_s=30)
    await nc.close()
    assert heartbeat.kv_blocks_free == heartbeat.kv_blocks_total, "the deleted conversation's reply still holds KV"
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=30) as client:
        # Gone after the reply ended too (that a late final write finds nothing is the store contract's case).
        assert (await client.get(path, headers=ALICE)).status_code == 404
        assert (await client.get(f"/v1/messages/{message_id}/stream", headers=ALICE)).status_code == 404
        listed = (await client.get("/v1/conversations", headers=ALICE)).json()["conversations"]
        assert conversation_id not in [c["id"] for c in listed]
        assert (await client.delete(path, headers=ALICE)).status_code == 404
        refused = await client.post(f"{path}/messages", headers=ALICE, json={"content": "hello?"})
        assert refused.status_code == 404


async def prompt_of(redis, reply_id: str) -> str:
    """The prompt the model was given for a reply, as text."""
    meta = await load_reply(redis, reply_id)
    assert meta is not None, f"reply {reply_id} has no log"
    return load_tokenizer(None).decode(GenerateRequest.FromString(meta.request).prompt_token_ids)


async def test_an_edited_message_branches_and_the_model_sees_only_the_branch_it_follows(product_stack):
    redis = aioredis.from_url(product_stack.redis_url)
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=120) as client:
        conversation_id = await new_conversation(client)
        first = await send(client, conversation_id, "My name is Ada. Say hi.")
        second = await send(client, conversation_id, "Which river flows through Paris?")
        await finished(client, conversation_id, second[0].data["message_id"])
        before = (await stored(client, conversation_id))["messages"]
        ada, hi, paris, paris_answer = before
        assert (hi["id"], paris_answer["id"]) == (first[0].data["message_id"], second[0].data["message_id"])
        assert (ada["parent_id"], hi["parent_id"], paris["parent_id"], paris_answer["parent_id"]) == (
            None,
            ada["id"],
            hi["id"],
            paris["id"],
        )

        edited = await send(client, conversation_id, "Which river flows through Rome?", edit_of=paris["id"])
        rome_answer_id = edited[0].data["message_id"]
        prompt = await prompt_of(redis, rome_answer_id)
        assert "Ada" in prompt and hi["content"].strip() in prompt and "Rome" in prompt
        assert "Paris" not in prompt and paris_answer["content"].strip() not in prompt, prompt
        await finished(client, conversation_id, rome_answer_id)
        conversation = await stored(client, conversation_id)
        branch = conversation["messages"]
        assert [m["id"] for m in branch[:2]] == [ada["id"], hi["id"]] and branch[3]["id"] == rome_answer_id
        assert branch[2]["content"] == "Which river flows through Rome?" and branch[2]["parent_id"] == hi["id"]
        assert [m["id"] for m in conversation["tree"]] == [m["id"] for m in before] + [branch[2]["id"], rome_answer_id]

        # Regenerating the answer on the edited branch keeps to that branch.
        async with client.stream(
            "POST", f"/v1/messages/{rome_answer_id}/regenerate", headers={**ALICE, "Accept": "text/event-stream"}, json=GREEDY
        ) as response:
            again = await read_stream(response)
        prompt = await prompt_of(redis, again[0].data["message_id"])
        assert "Rome" in prompt and "Paris" not in prompt, prompt

        # Continuing the old branch (the reader switched back to it): the model sees that one.
        later = await send(client, conversation_id, "How long is it?", parent_id=paris_answer["id"])
        prompt = await prompt_of(redis, later[0].data["message_id"])
        assert "Paris" in prompt and paris_answer["content"].strip() in prompt and "Rome" not in prompt, prompt
        await finished(client, conversation_id, later[0].data["message_id"])
        branch = (await stored(client, conversation_id))["messages"]
        assert [m["id"] for m in branch[:4]] == [m["id"] for m in before] and branch[5]["id"] == later[0].data["message_id"]

        # Editing the first message starts afresh: nothing before it.
        fresh = await send(client, conversation_id, "Say hello to Bob.", edit_of=ada["id"])
        prompt = await prompt_of(redis, fresh[0].data["message_id"])
        assert "Bob" in prompt and "Ada" not in prompt and "Paris" not in prompt, prompt

        url = f"/v1/conversations/{conversation_id}/messages"
        for body, code in (
            ({"parent_id": ada["id"]}, "bad_parent"),
            ({"edit_of": hi["id"]}, "bad_edit_of"),
            ({"parent_id": "nope"}, "bad_parent"),
        ):
            refused = await client.post(url, headers=ALICE, json={"content": "hi", **body})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == code, refused.text
        both = await client.post(url, headers=ALICE, json={"content": "hi", "parent_id": hi["id"], "edit_of": ada["id"]})
        assert both.status_code == 400, both.text
    await redis.aclose()


async def test_a_served_model_name_is_the_id_clients_list_and_ask_for(product_stack):
    """A second decode worker on the stack's bus serves the same file as "house-model"."""
    env = service_env(
        "decode", product_stack.nats_url, product_stack.redis_url, TANDEM_KV_CACHE_MIB="128", TANDEM_SERVED_MODEL_NAME="house-model"
    )
    worker = service_process("decode", env)
    worker.start()
    nc = await nats.connect(product_stack.nats_url)
    try:
        await next_heartbeat(nc, "decode", env["TANDEM_INSTANCE_ID"], accept=lambda hb: hb.is_ready, timeout_s=180)
        async with httpx.AsyncClient(base_url=product_stack.url, headers=ALICE, timeout=120) as client:

            async def listed() -> list[str] | None:
                ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
                return ids if "house-model" in ids else None

            assert "SmolLM2-135M-Instruct" in await wait_until(listed, timeout_s=10)
            assert (await client.get("/v1/models/house-model")).json()["id"] == "house-model"
            body = {"model": "house-model", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}
            completion = await client.post("/v1/chat/completions", json=body)
            assert completion.status_code == 200, completion.text
            assert completion.json()["model"] == "house-model" and completion.json()["choices"][0]["message"]["content"]
    finally:
        worker.stop(timeout_s=10)
        await nc.close()
    async with httpx.AsyncClient(base_url=product_stack.url, headers=ALICE, timeout=30) as client:

        async def forgotten() -> bool:
            return "house-model" not in [m["id"] for m in (await client.get("/v1/models")).json()["data"]]

        await wait_until(forgotten, timeout_s=15)  # the stack serves only its own model again for the tests after
