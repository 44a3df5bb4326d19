"""What a client is told when something goes wrong: a stable code, a human message and the request
id (also in the X-Request-Id header), and nothing internal: no instance ids, host name, pids,
store paths or hosts, bus or driver words, exception class names. The chat's log has the details
under that request id."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from product_stack import ALICE, ProductStack

pytestmark = pytest.mark.real_model

INTERNAL_WORDS = ("nats", "sqlite", "redis", "cassandra", "locked", "Error", "Exception", "Traceback", "StoreUnavailable")


def assert_clean_error(stack: ProductStack, response: httpx.Response, status: int, code: str) -> dict:
    """The error of `response`, checked: its code and request id, and nothing internal in it."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    assert error["request_id"] == response.headers["x-request-id"]
    internals = [*INTERNAL_WORDS, socket.gethostname(), str(stack.store_path), str(stack.store_path.name)]
    internals += [instance_id for ids in stack.ids.values() for instance_id in ids]
    internals += [f"pid {child.pid}" for child in stack.children] + [f"pid={child.pid}" for child in stack.children]
    leaked = [word for word in internals if word in response.text]
    assert not leaked, f"{leaked} in {response.text}"
    return error


@contextlib.contextmanager
def store_locked(path: Path) -> Iterator[None]:
    """Another writer holds the conversation store: the chat's writes fail after its busy timeout."""
    holder = sqlite3.connect(path, isolation_level=None, timeout=10)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def chat_line_with(stack: ProductStack, pattern: str, timeout_s: float) -> str | None:
    """A line of a chat instance's log that matches `pattern`, waited for up to `timeout_s`."""
    for child in (c for c in stack.children if c.name == "chat"):
        match = child.wait_for_line(pattern, timeout_s)
        if match is not None:
            return match.string
    return None


async def test_a_failing_store_is_a_503_with_a_request_id_and_its_details_only_in_the_log(product_stack):
    request_id = f"e2e-store-{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=60) as client:
        with store_locked(product_stack.store_path):
            response = await client.post("/v1/conversations", headers={**ALICE, "X-Request-Id": request_id}, json={})
        error = assert_clean_error(product_stack, response, 503, "store_unavailable")
        assert error["request_id"] == request_id and int(response.headers["retry-after"]) >= 1
        # The store is back: the same request goes through, with an id of its own.
        again = await client.post("/v1/conversations", headers=ALICE, json={})
        assert again.status_code == 201 and again.headers["x-request-id"] != request_id
    line = await asyncio.to_thread(chat_line_with, product_stack, rf"request {request_id}: store unavailable", 10)
    assert line is not None and "locked" in line, "the log has what the client was not told"


async def test_bad_bodies_unknown_routes_and_wrong_methods_answer_code_message_and_request_id(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=60) as client:
        not_json = await client.post(
            "/v1/chat/completions", headers={**ALICE, "Content-Type": "application/json"}, content=b'{"model": "auto", "messages": ['
        )
        assert_clean_error(product_stack, not_json, 400, "bad_request")
        wrong_type = await client.post("/v1/chat/completions", headers=ALICE, json={"model": 7, "messages": "hi"})
        assert_clean_error(product_stack, wrong_type, 400, "bad_request")
        unknown = await client.get("/v1/nowhere", headers={"X-Request-Id": 'bad id "quoted"'})
        error = assert_clean_error(product_stack, unknown, 404, "http_404")
        assert error["request_id"] != 'bad id "quoted"', "an insane id is replaced, never echoed"
        wrong_method = await client.delete("/v1/models", headers=ALICE)
        assert_clean_error(product_stack, wrong_method, 405, "http_405")
        unauthenticated = await client.post("/v1/conversations", json={})
        assert_clean_error(product_stack, unauthenticated, 401, "invalid_api_key")
