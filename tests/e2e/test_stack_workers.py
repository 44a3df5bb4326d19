"""`tandem up --decode-workers 2 --prefill-workers 1` through the Stack API the failure drills use:
every worker comes up with its own instance id and ports, the router sees each, a SIGKILLed
decode worker is restarted under the same instance id, a restarted Redis leaves the stack ready,
and an answer still streams end to end afterwards."""

from __future__ import annotations

import asyncio
import io
import signal

import httpx

from tandem.config import ApiKey, Tier
from tandem.devstack.members import StackConfig
from tandem.devstack.proc import free_port
from tandem.devstack.stack import Console, Stack

KEY = "key-drill"
READY_S = 240.0


async def router_lists(router_url: str, instance_ids: set[str], role: str) -> None:
    async with httpx.AsyncClient(base_url=router_url, timeout=5) as http, asyncio.timeout(60):
        while {w["instance_id"] for w in (await http.get("/workers")).json()[role]} != instance_ids:
            await asyncio.sleep(0.2)


async def answer(chat_url: str) -> str:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=chat_url, headers=headers, timeout=120) as http:
        conversation = (await http.post("/v1/conversations", json={})).json()["id"]
        body = {"content": "What is the capital of France?", "temperature": 0, "max_tokens": 12}
        async with http.stream("POST", f"/v1/conversations/{conversation}/messages", json=body) as response:
            assert response.status_code == 200
            return "".join([line async for line in response.aiter_lines()])


async def test_two_decode_workers_and_a_prefill_worker_each_run_supervised_and_the_servers_restart(tmp_path):
    log = io.StringIO()
    config = StackConfig(
        host="127.0.0.1",
        chat_port=free_port(),
        api_keys={KEY: ApiKey("drill", Tier.PLUS)},
        extra_env={"TANDEM_SQLITE_PATH": str(tmp_path / "conversations.db"), "TANDEM_KV_CACHE_MIB": "128"},
        num_decode_workers=2,
        num_prefill_workers=1,
        ready_timeout_s=READY_S,
    )
    try:
        async with Stack(config, Console(log)) as stack:
            decode = stack.members_of("decode")
            assert [m.name for m in decode] == ["decode-0", "decode-1"]
            ports = [p for m in stack.members for p in (m.http_port, m.ops_port, m.grpc_port) if p is not None]
            assert len(ports) == len(set(ports))
            router = stack.member("router").url
            await router_lists(router, {"decode-0", "decode-1"}, "decode")
            await router_lists(router, {"prefill-0"}, "prefill")

            old_pid = stack.send_signal("decode-1", signal.SIGKILL)
            async with asyncio.timeout(60):
                while stack.member("decode-1").pid in (None, old_pid):
                    await asyncio.sleep(0.1)
            await stack.wait_ready("decode-1", READY_S)
            await router_lists(router, {"decode-0", "decode-1"}, "decode")

            await stack.restart("redis", timeout_s=30)
            async with httpx.AsyncClient(timeout=5) as http, asyncio.timeout(60):
                while (await http.get(f"{stack.member('chat').ops_url}/readyz")).status_code != 200:
                    await asyncio.sleep(0.2)
            assert "Paris" in await answer(stack.chat_urls[0])
    except BaseException:
        print(log.getvalue()[-20000:])
        raise
    assert "decode-1 exited (killed by SIGKILL); restarting in 1 s" in log.getvalue()
