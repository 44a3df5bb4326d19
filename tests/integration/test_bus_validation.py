"""A real router process reads only sound bus messages: a heartbeat naming an insane address, one
sent on another worker's subject, garbage and a KV event for another worker are dropped, counted
by kind and reason on /metrics and logged once per sender subject, and the router goes on
serving (a sound heartbeat right after them is seen; a generate request with an unknown lane is
refused as a bad request)."""

from __future__ import annotations

import re
import uuid

import httpx
from helpers import next_heartbeat, ops_url, service_env, service_process, wait_until

from tandem.bus import decode, encode, subjects
from tandem.v1.common_pb2 import SamplingParams
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest
from tandem.v1.kv_pb2 import BlocksStored, KvEvent, StoredBlock
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat

WAIT_S = 10.0


def heartbeat(instance_id: str, **fields) -> WorkerHeartbeat:
    service = ServiceHeartbeat(role="decode", instance_id=instance_id, is_ready=True, interval_s=0.2)
    return WorkerHeartbeat(
        service=service, model="m", max_model_len=4096, is_engine_ready=True, kv_block_size=16, kv_blocks_total=64, **fields
    )


def dropped(metrics_text: str, kind: str, reason: str) -> float:
    pattern = rf'^tandem_bus_messages_dropped_total\{{kind="{kind}",reason="{reason}"\}} (\S+)$'
    match = re.search(pattern, metrics_text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_the_router_drops_bad_bus_messages_counts_them_and_keeps_serving(nats_server, redis_server, nc):
    env = service_env("router", nats_server.url, redis_server.url)
    child = service_process("router", env)
    child.start()
    url = f"http://127.0.0.1:{env['TANDEM_HTTP_PORT']}"
    try:
        await next_heartbeat(nc, "router", env["TANDEM_INSTANCE_ID"], accept=lambda hb: hb.is_ready, timeout_s=30)
        spoofer, victim, sound = (f"decode-{name}-{uuid.uuid4().hex[:6]}" for name in ("spoof", "victim", "sound"))
        spoofed_subject = subjects.heartbeat("decode", spoofer)
        for _ in range(3):  # a flood from one sender: counted three times, logged once
            await nc.publish(spoofed_subject, encode(heartbeat(spoofer, grpc_address="evil host:99999")))
        await nc.publish(subjects.heartbeat("decode", victim), encode(heartbeat(spoofer)))  # another worker's subject
        await nc.publish(subjects.heartbeat("decode", victim), b"\xff\xff\xff")
        other_worker = KvEvent(worker_id=victim, event_id=1, stored=BlocksStored(blocks=[StoredBlock(block_hash=1, num_tokens=16)]))
        await nc.publish(subjects.kv_events(spoofer), encode(other_worker))
        await nc.publish(subjects.heartbeat("decode", sound), encode(heartbeat(sound, grpc_address="127.0.0.1:50051")))
        await nc.flush()

        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:

            async def sound_worker_listed() -> list[str]:
                listed = [w["instance_id"] for w in (await client.get("/workers")).json()["decode"]]
                return listed if sound in listed else []

            listed = await wait_until(sound_worker_listed, timeout_s=WAIT_S)
            assert spoofer not in listed and victim not in listed

            async def all_counted() -> str:  # KV events have a subscription (and a task) of their own
                text = (await client.get(f"{ops_url(env)}/metrics")).text
                return text if dropped(text, "kv_event", "id_mismatch") >= 1 else ""

            metrics_text = await wait_until(all_counted, timeout_s=WAIT_S)

        assert dropped(metrics_text, "heartbeat", "bad_address") == 3
        assert dropped(metrics_text, "heartbeat", "id_mismatch") == 1
        assert dropped(metrics_text, "heartbeat", "undecodable") == 1
        assert dropped(metrics_text, "kv_event", "id_mismatch") == 1

        bad_lane = GenerateRequest(
            reply_id=uuid.uuid4().hex, model="m", prompt_token_ids=[1, 2], lane=9, sampling=SamplingParams(max_tokens=4)
        )
        answer = decode((await nc.request(subjects.GENERATE, encode(bad_lane), timeout=WAIT_S)).data, GenerateReply)
        assert (answer.refused.reason, "lane 9" in answer.refused.message) == ("bad_request", True)
    finally:
        child.stop(timeout_s=10)
    logged = [line for line in child.recent_output(400).splitlines() if f"dropped a heartbeat on {spoofed_subject}" in line]
    assert len(logged) == 1 and "bad_address" in logged[0], logged
