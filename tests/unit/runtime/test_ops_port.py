"""The ops port: where it is (the HTTP port + 1000 unless set; any free port with an HTTP port of
0; a start that fails, naming the setting, past 65535), and what answers there rather than on the
service's own port."""

import httpx
import pytest
from fastapi import APIRouter

from tandem.config import load_settings
from tandem.errors import StartupError
from tandem.runtime import Runtime, RuntimeConfig, create_app
from tandem.runtime.ops_port import ops_port_for

OPS_PATHS = ("/healthz", "/metrics", "/version", "/openapi.json", "/docs", "/redoc")


@pytest.mark.parametrize(
    ("overrides", "role", "expected"),
    [
        ({}, "chat", 9080),
        ({}, "decode", 9084),
        ({"http_port": 18080}, "chat", 19080),
        ({"http_port": 0}, "relay", 0),
        ({"ops_port": 7000}, "chat", 7000),
    ],
)
def test_the_ops_port_is_the_setting_or_the_http_port_plus_1000(overrides, role, expected):
    assert ops_port_for(load_settings(**overrides), role) == expected


def test_an_ops_port_past_65535_fails_at_start_naming_the_setting():
    with pytest.raises(StartupError, match="TANDEM_OPS_PORT"):
        ops_port_for(load_settings(http_port=65000), "chat")


async def test_the_service_port_answers_its_routes_and_the_ops_app_the_ops_paths_with_the_service_schema():
    router = APIRouter()

    @router.get("/v1/things")
    async def things() -> list[str]:
        return []

    runtime = Runtime(RuntimeConfig("router", "router-1", "http://127.0.0.1:1", "nats://127.0.0.1:1", None, 1.0))
    app = create_app(runtime, routers=[router])
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://service") as service,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app.state.ops_app), base_url="http://ops") as ops,
    ):
        assert (await service.get("/v1/things")).status_code == 200
        assert (await ops.get("/v1/things")).status_code == 404
        for path in OPS_PATHS:
            assert (await service.get(path)).status_code == 404, path
            assert (await ops.get(path)).status_code == 200, path
        assert set((await ops.get("/openapi.json")).json()["paths"]) == {"/v1/things"}
