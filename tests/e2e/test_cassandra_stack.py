"""The whole stack on a real Cassandra node (TANDEM_STORE=cassandra): a conversation of three
turns, a stopped reply and a reload read back from Cassandra; then the node is killed (the chat
service answers 503 with a clear message, quickly) and started again (it recovers by itself).

The stack here has its own nats-server and redis-server, so its relays never see the replies
of the SQLite stack other tests use."""

from __future__ import annotations

import os
import time

import httpx
import nats
import pytest
import pytest_asyncio
from helpers import cassandra_tools_missing, migrate_cassandra, wait_until
from product_stack import ALICE, SseReader, read_stream, start_product_stack, text_of

from tandem.devstack.cassandra_node import NodeConfig, start_node, stop_node
from tandem.devstack.servers import init_token_stream, start_nats, start_redis

pytestmark = pytest.mark.real_model
STORE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def node_config(tmp_path_factory):
    if (reason := cassandra_tools_missing()) is not None:
        if os.environ.get("TANDEM_REQUIRE_CASSANDRA") == "1":
            pytest.fail(f"TANDEM_REQUIRE_CASSANDRA=1 but no Cassandra: {reason}", pytrace=False)
        pytest.skip(f"!!! CASSANDRA STACK NOT TESTED: {reason}")
    return NodeConfig(node_dir=tmp_path_factory.mktemp("cassandra-stack"), is_durable=False)


@pytest_asyncio.fixture(scope="module")
async def cassandra_stack(node_config, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cassandra-servers")
    node = start_node(node_config)
    login = await migrate_cassandra(node.hosts, "tandem", ca_file=node.ca_file)  # the admin step; the services log in as its role
    nats_server, redis_server = start_nats(workdir), start_redis(workdir)
    init_token_stream(nats_server)  # the admin step: services only wait for the stream
    nc = await nats.connect(nats_server.url)
    stack = await start_product_stack(
        nc,
        nats_server.url,
        redis_server.url,
        workdir,
        TANDEM_STORE="cassandra",
        TANDEM_CASSANDRA_HOSTS=node.hosts,
        TANDEM_CASSANDRA_USERNAME=login["username"],
        TANDEM_CASSANDRA_PASSWORD=login["password"],
        TANDEM_CASSANDRA_CA_FILE=node.ca_file,  # the node takes TLS clients only
        TANDEM_STORE_TIMEOUT_S=str(STORE_TIMEOUT_S),
    )
    await nc.close()
    holder = {"stack": stack, "node": node}
    yield holder
    for child in stack.children:  # shown with the last test's report when it fails
        print(f"==== {child.name}\n{child.recent_output(60)}")
        child.stop(timeout_s=10)
    if holder["node"].is_alive():
        stop_node(holder["node"], kill=True)
    redis_server.stop()
    nats_server.stop()


async def test_three_turns_stop_and_reload_on_cassandra(cassandra_stack):
    stack = cassandra_stack["stack"]
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as client:
        conversation_id = (await client.post("/v1/conversations", headers=ALICE, json={})).json()["id"]
        replies = []
        for question in ("What is the capital of France?", "And of Spain?", "Which is bigger?"):
            async with client.stream(
                "POST",
                f"/v1/conversations/{conversation_id}/messages",
                headers=ALICE,
                json={"content": question, "temperature": 0, "max_tokens": 16},
            ) as response:
                events = await read_stream(response)
            assert events[-1].event == "done"
            replies.append(events)
        assert all(r[-1].data["usage"]["cached"] > 0 for r in replies[1:])
        async with client.stream(
            "POST",
            f"/v1/conversations/{conversation_id}/messages",
            headers=ALICE,
            json={"content": "Now write a long poem about both.", "temperature": 0, "max_tokens": 400},
        ) as response:
            reader = SseReader(response)
            head = await reader.read(stop_after=3)
            stopped_id = head[0].data["message_id"]
            assert (await client.post(f"/v1/messages/{stopped_id}/stop", headers=ALICE)).status_code == 200
            stopped = head + await reader.read()
        assert stopped[-1].data["finish"] == "cancelled"

    # A reload from another chat instance: everything comes back from Cassandra.
    async with httpx.AsyncClient(base_url=stack.chat_urls[1], timeout=60) as client:

        async def reloaded():
            body = (await client.get(f"/v1/conversations/{conversation_id}", headers=ALICE)).json()
            return body if body["messages"] and body["messages"][-1]["status"] != "running" else None

        conversation = await wait_until(reloaded)
        assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"] * 4
        assert [m["content"] for m in conversation["messages"][1:6:2]] == [text_of(r) for r in replies]
        assert conversation["messages"][-1]["status"] == "stopped"
        assert conversation["messages"][-1]["content"] == text_of(stopped)
        listed = (await client.get("/v1/conversations", headers=ALICE)).json()["conversations"]
        assert listed[0]["id"] == conversation_id


async def test_a_dead_node_is_a_clear_503_and_the_service_recovers_when_it_is_back(cassandra_stack, node_config):
    stack = cassandra_stack["stack"]
    # A connection per request: the node's restart blocks this loop for about the chat service's
    # keep-alive (5 s), and a request sent on a kept connection as the server closes it is lost.
    fresh_connections = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=fresh_connections) as client:
        conversation_id = (await client.post("/v1/conversations", headers=ALICE, json={})).json()["id"]
        node = cassandra_stack["node"]
        stop_node(node, kill=True)
        started_s = time.monotonic()
        response = await client.get("/v1/conversations", headers=ALICE)
        assert response.status_code == 503, response.text
        assert time.monotonic() - started_s < STORE_TIMEOUT_S * 3, "answered within the store's timeout, not hung"
        error = response.json()["error"]
        assert error["code"] == "store_unavailable" and "store" in error["message"]
        assert "Traceback" not in response.text and response.headers.get("Retry-After")
        posted = await client.post(f"/v1/conversations/{conversation_id}/messages", headers=ALICE, json={"content": "hi"})
        assert posted.status_code == 503
        assert (await client.get(f"{stack.chat_ops_url}/readyz")).status_code == 503

        cassandra_stack["node"] = start_node(
            NodeConfig(node_dir=node_config.node_dir, native_port=node.native_port, storage_port=node.storage_port, is_durable=False)
        )

        async def answers():
            return (await client.get(f"/v1/conversations/{conversation_id}", headers=ALICE)).status_code == 200

        await wait_until(answers, timeout_s=120, interval_s=0.5)
        async with client.stream(
            "POST",
            f"/v1/conversations/{conversation_id}/messages",
            headers=ALICE,
            json={"content": "Are you back?", "temperature": 0, "max_tokens": 8},
        ) as response:
            assert (await read_stream(response))[-1].event == "done"
