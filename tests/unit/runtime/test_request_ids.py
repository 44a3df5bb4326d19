"""Every answer of a service's app carries a request id (the caller's when sane); an error body has
a code, a message and that id, never an exception's text, which the log has under the id."""

import logging

import httpx
import pytest
from fastapi import APIRouter

from tandem.runtime import Runtime, RuntimeConfig, create_app
from tandem.runtime.request_id import request_id_from

SECRET = "cassandra-7.internal:9042 refused; pid 4242"


def app_with_a_bug():
    router = APIRouter()

    @router.get("/boom")
    async def boom() -> None:
        raise RuntimeError(SECRET)

    @router.get("/items/{item_id}")
    async def item(item_id: int) -> dict[str, int]:
        return {"item_id": item_id}

    runtime = Runtime(RuntimeConfig("router", "router-1", "http://127.0.0.1:1", "nats://127.0.0.1:1", None, 1.0))
    return create_app(runtime, routers=[router])


@pytest.fixture
async def client():
    transport = httpx.ASGITransport(app=app_with_a_bug(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def test_an_unexpected_error_is_a_500_with_a_request_id_and_the_details_only_in_the_log(client, caplog):
    with caplog.at_level(logging.ERROR, logger="tandem.runtime.request_id"):
        response = await client.get("/boom", headers={"X-Request-Id": "req-123"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert (error["code"], error["request_id"], response.headers["x-request-id"]) == ("internal_error", "req-123", "req-123")
    assert SECRET not in response.text and "RuntimeError" not in response.text
    (logged,) = [r for r in caplog.records if "req-123" in r.getMessage()]
    assert logged.exc_info is not None and SECRET in str(logged.exc_info[1])


async def test_framework_and_validation_refusals_carry_the_request_id_too(client):
    missing = await client.get("/nowhere")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "http_404"
    assert missing.json()["error"]["request_id"] == missing.headers["x-request-id"]
    bad = await client.get("/items/abc")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_request"
    assert "item_id" in bad.json()["error"]["message"]


async def test_every_answer_gets_a_fresh_id_unless_the_caller_sent_a_sane_one(client):
    first, second = (await client.get("/items/1")), (await client.get("/items/1"))
    assert first.headers["x-request-id"] != second.headers["x-request-id"]
    insane = await client.get("/items/1", headers={"X-Request-Id": 'a b"<script>'})
    assert insane.headers["x-request-id"] != 'a b"<script>'


@pytest.mark.parametrize("value", [None, "", "x" * 129, "bad id", "a\nb", "ü"])
def test_an_insane_incoming_id_is_replaced(value):
    assert request_id_from(value) != value and len(request_id_from(value)) == 32


def test_a_sane_incoming_id_is_kept():
    assert request_id_from("0f8e-4c:trace.1_x") == "0f8e-4c:trace.1_x"
