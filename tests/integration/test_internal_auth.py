"""The workers' internal surfaces refuse strangers: a gRPC call without the internal secret is
UNAUTHENTICATED (with it, it is served), and a KV transfer is let into reserved blocks only with the
token of that reservation, which only the caller of Reserve learns. Real decode worker, real gRPC,
real UCXX endpoints; the KV listener answers only on its host's interface."""

from __future__ import annotations

import ipaddress
import socket
import sys
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import pytest_asyncio
import torch
import ucxx
from helpers import next_heartbeat, service_env, service_process
from prometheus_client import REGISTRY

from tandem.kvtransfer import Destination, KvReceiver, KvSender, KvTransferError, new_token, wire
from tandem.v1 import common_pb2, control_pb2, control_pb2_grpc
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.kv_handoff_pb2 import KvLayout, ReleaseRequest, ReserveRequest
from tandem.v1.kv_handoff_pb2_grpc import KvHandoffStub
from tandem.worker.internal_grpc import internal_channel

SECRET = "internal-auth-test-secret"
HOST = "127.0.0.1"
BLOCK_SHAPE = (30, 2, 16, 3, 64)  # SmolLM2-135M: layers, K/V, tokens per block, KV heads, head dim
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def decode_worker(nats_server, redis_server) -> Iterator[str]:
    env = service_env(
        "decode", nats_server.url, redis_server.url, TANDEM_DTYPE="fp32", TANDEM_KV_CACHE_MIB="64", TANDEM_INTERNAL_SECRET=SECRET
    )
    child = service_process("decode", env)
    child.start()
    yield env["TANDEM_INSTANCE_ID"]
    child.stop(timeout_s=10)


@pytest_asyncio.fixture
async def sender() -> AsyncIterator[KvSender]:
    kv_sender = KvSender()
    yield kv_sender
    await kv_sender.close()
    ucxx.reset()  # raises if an endpoint or listener of the test is still open


def refused_count(reason: str) -> float:
    return REGISTRY.get_sample_value("tandem_kv_transfers_refused_total", {"reason": reason}) or 0.0


async def test_worker_control_refuses_a_call_without_the_secret_and_serves_one_with_it(decode_worker, nc):
    ready = await next_heartbeat(nc, "decode", decode_worker, accept=lambda hb: hb.is_ready, timeout_s=120)
    for secret in ("", "not-the-secret"):
        async with internal_channel(ready.grpc_address, secret) as channel:
            for call in (
                control_pb2_grpc.WorkerControlStub(channel).Health(control_pb2.HealthRequest(), timeout=10),
                control_pb2_grpc.WorkerControlStub(channel).Drain(control_pb2.DrainRequest(), timeout=10),
                KvHandoffStub(channel).Release(ReleaseRequest(reply_id="reply-x"), timeout=10),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with internal_channel(ready.grpc_address, SECRET) as channel:
        health = await control_pb2_grpc.WorkerControlStub(channel).Health(control_pb2.HealthRequest(), timeout=10)
    assert health.status == control_pb2.HealthReply.STATUS_SERVING  # and the refused Drain never drained it


async def test_the_decode_worker_lets_in_only_the_transfer_with_its_reservations_token(decode_worker, nc, sender: KvSender):
    ready = await next_heartbeat(nc, "decode", decode_worker, accept=lambda hb: hb.is_ready, timeout_s=120)
    layout = KvLayout(
        model=ready.model, dtype="float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64, byte_order=sys.byteorder
    )
    request = GenerateRequest(
        model="auto", prompt_token_ids=list(range(1000, 1040)), lane=common_pb2.LANE_PAID, sampling=common_pb2.SamplingParams(max_tokens=2)
    )
    async with internal_channel(ready.grpc_address, SECRET) as channel:
        stub = KvHandoffStub(channel)
        ours, theirs = [
            (await stub.Reserve(ReserveRequest(reply_id=reply_id, layout=layout, num_blocks=3, request=request), timeout=10)).reservation
            for reply_id in ("reply-ours", "reply-theirs")
        ]
        try:
            assert len(ours.transfer_token) == wire.TOKEN_BYTES and ours.transfer_token != theirs.transfer_token
            blocks = list(torch.randn((len(ours.block_ids), *BLOCK_SHAPE)))
            where = (ours.ucx_host, ours.ucx_port)
            for token, reason in ((theirs.transfer_token, "bad_token"), (b"", "bad_token"), (new_token(), "bad_token")):
                with pytest.raises(KvTransferError) as refused:
                    await sender.send(*where, "reply-ours", blocks, TIMEOUT_S, token=token)
                assert refused.value.reason == reason
            with pytest.raises(KvTransferError) as refused:
                await sender.send(*where, "reply-nobody-reserved", blocks, TIMEOUT_S, token=ours.transfer_token)
            assert refused.value.reason == "unknown_reply"

            await sender.send(*where, "reply-ours", blocks, TIMEOUT_S, token=ours.transfer_token)  # acknowledged: landed
        finally:
            for reply_id in ("reply-ours", "reply-theirs"):
                await stub.Release(ReleaseRequest(reply_id=reply_id), timeout=10)


async def test_a_foreign_write_leaves_the_reserved_blocks_untouched_and_is_counted(sender: KvSender):
    pool = torch.randn((16, *BLOCK_SHAPE), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before = pool.clone()
    token = new_token()
    reserved = {"reply-1": Destination([pool[b] for b in (3, 7, 11)], token)}
    receiver = KvReceiver(HOST, 0, resolve=reserved.get)
    await receiver.start()
    try:
        blocks = list(torch.randn((3, *BLOCK_SHAPE), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16))
        num_refused = refused_count("bad_token")
        with pytest.raises(KvTransferError) as refused:
            await sender.send(receiver.host, receiver.port, "reply-1", blocks, TIMEOUT_S, token=new_token())
        assert refused.value.reason == "bad_token"
        assert refused_count("bad_token") == num_refused + 1
        assert not await receiver.wait_received("reply-1", timeout_s=0)
        assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8)), "a refused transfer wrote into the pool"

        await sender.send(receiver.host, receiver.port, "reply-1", blocks, TIMEOUT_S, token=token)
        assert await receiver.wait_received("reply-1", timeout_s=0)
        assert torch.equal(pool[[3, 7, 11]].view(torch.uint8), torch.stack(blocks).view(torch.uint8))
    finally:
        await receiver.stop()


def _other_local_address() -> str | None:
    """An address of this machine that is not loopback (the default route's source), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def _can_connect(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


async def test_the_kv_listener_takes_connections_only_on_its_hosts_interface(sender: KvSender):
    other = _other_local_address()
    if other is None:
        pytest.skip("this machine has no address but loopback")
    receiver = KvReceiver(HOST, 0, resolve=lambda reply_id: None, listen_host=HOST)
    await receiver.start()
    try:
        assert _can_connect(HOST, receiver.port)
        assert not _can_connect(other, receiver.port), f"the KV listener answered on {other}"
    finally:
        await receiver.stop()
