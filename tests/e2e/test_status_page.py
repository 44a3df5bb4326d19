"""GET /v1/status on the product stack: public, no secrets, the routers' ladder and the models."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest
from helpers import wait_until
from product_stack import ALICE

pytestmark = pytest.mark.real_model


async def test_the_status_is_public_and_shows_the_ladder_and_the_models_served(product_stack):
    async with httpx.AsyncClient(base_url=product_stack.url, timeout=10) as client:

        async def reported() -> dict | None:
            response = await client.get("/v1/status")  # no API key
            assert response.status_code == 200, response.text
            body = response.json()
            return body if body["rung"] is not None else None

        # The router reports at start and then every 10 s (ladder_interval_s).
        body = await wait_until(reported, timeout_s=25)
        served = [m["id"] for m in (await client.get("/v1/models", headers=ALICE)).json()["data"]]
        text = (await client.get("/v1/status")).text
    assert body["status"] == ("normal" if body["rung"] == 0 else "degraded")
    assert body["rung"] in range(4) and 0 <= body["busyness"] <= 1
    assert body["models"] == sorted(served) and served
    observed_at = datetime.fromisoformat(body["observed_at"].replace("Z", "+00:00"))
    assert datetime.now(UTC) - timedelta(seconds=60) < observed_at <= datetime.now(UTC) + timedelta(seconds=5)
    for secret in ("key-alice", "key-bob", *product_stack.ids["router"]):
        assert secret not in text
