"""The KV handoff data path over real UCXX endpoints on loopback: a KvSender writes a reply's
blocks into a KvReceiver's KV pool, laid out like the engine's cache, at the reserved block ids."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import numpy as np
import pytest
import pytest_asyncio
import torch
import ucxx

from tandem.devstack.proc import free_port
from tandem.kvtransfer import Destination, KvReceiver, KvSender, KvTransferError, wire
from tandem.kvtransfer.wire import Kind, Reply, Status

BLOCK_SHAPE = (30, 2, 16, 3, 64)  # SmolLM2-135M: layers, K/V, tokens per block, KV heads, head dim
NUM_POOL_BLOCKS = 64
HOST = "127.0.0.1"
TIMEOUT_S = 30.0
TOKEN = wire.new_token()  # every reservation's here (tests/integration/test_kv_handoff_auth.py: one each)


class Reservations:
    """The decode worker's part, as its gRPC service plays it: reply id -> reserved blocks of a pool."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        self.block_ids: dict[str, list[int]] = {}

    def reserve(self, reply_id: str, block_ids: list[int]) -> None:
        self.block_ids[reply_id] = block_ids

    def resolve(self, reply_id: str) -> Destination | None:
        block_ids = self.block_ids.get(reply_id)
        return None if block_ids is None else Destination([self.pool[b] for b in block_ids], TOKEN)


def random_pool(dtype: torch.dtype, num_blocks: int = NUM_POOL_BLOCKS, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *BLOCK_SHAPE), generator=generator).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_untouched(pool: torch.Tensor, before: torch.Tensor, except_ids: Iterable[int] = ()) -> None:
    skipped = set(except_ids)
    others = [b for b in range(pool.shape[0]) if b not in skipped]
    assert same_bytes(pool[others], before[others])


@pytest_asyncio.fixture
async def ucx() -> AsyncIterator[None]:
    yield
    ucxx.reset()  # raises if an endpoint or listener of the test is still open


StartReceiver = Callable[[torch.Tensor], Awaitable[tuple[KvReceiver, Reservations]]]


@pytest_asyncio.fixture
async def start_receiver(ucx: None) -> AsyncIterator[StartReceiver]:
    receivers: list[KvReceiver] = []

    async def start(pool: torch.Tensor) -> tuple[KvReceiver, Reservations]:
        reservations = Reservations(pool)
        receiver = KvReceiver(HOST, 0, resolve=reservations.resolve)
        await receiver.start()
        receivers.append(receiver)
        return receiver, reservations

    yield start
    for receiver in receivers:
        await receiver.stop()


@pytest_asyncio.fixture
async def sender(ucx: None) -> AsyncIterator[KvSender]:
    kv_sender = KvSender()
    yield kv_sender
    await kv_sender.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=["bf16", "fp32", "fp8"])
async def test_blocks_land_in_the_reserved_blocks_and_nowhere_else(start_receiver: StartReceiver, sender: KvSender, dtype):
    prefill_pool = random_pool(dtype, seed=1)
    pool = random_pool(dtype, seed=2)
    before = pool.clone()
    receiver, reservations = await start_receiver(pool)
    source_ids, dest_ids = [7, 8, 9, 10, 11, 12], [41, 3, 17, 58, 9, 30]
    reservations.reserve("reply-1", dest_ids)
    waiting = asyncio.create_task(receiver.wait_received("reply-1", TIMEOUT_S))  # as Commit may, early

    await sender.send(receiver.host, receiver.port, "reply-1", [prefill_pool[b] for b in source_ids], TIMEOUT_S, token=TOKEN)

    assert await receiver.wait_received("reply-1", timeout_s=0)  # landed before send() returned
    assert await waiting
    for source, dest in zip(source_ids, dest_ids):
        assert same_bytes(pool[dest], prefill_pool[source])
    assert_untouched(pool, before, dest_ids)


async def test_unknown_reply_is_refused_and_nothing_is_written(start_receiver: StartReceiver, sender: KvSender):
    pool = random_pool(torch.bfloat16)
    before = pool.clone()
    receiver, reservations = await start_receiver(pool)
    reservations.reserve("reply-known", [1, 2])

    with pytest.raises(KvTransferError, match="unknown reply") as refused:
        await sender.send(
            receiver.host, receiver.port, "reply-unknown", list(random_pool(torch.bfloat16, 2, seed=3)), TIMEOUT_S, token=TOKEN
        )

    assert refused.value.reason == "unknown_reply"
    assert_untouched(pool, before)
    assert not await receiver.wait_received("reply-unknown", timeout_s=0.05)


async def test_block_count_mismatch_is_refused(start_receiver: StartReceiver, sender: KvSender):
    pool = random_pool(torch.bfloat16)
    before = pool.clone()
    receiver, reservations = await start_receiver(pool)
    reservations.reserve("reply-1", [4, 5, 6])

    with pytest.raises(KvTransferError, match="3 blocks reserved, 4 sent") as refused:
        await sender.send(receiver.host, receiver.port, "reply-1", list(random_pool(torch.bfloat16, 4, seed=3)), TIMEOUT_S, token=TOKEN)

    assert refused.value.reason == "count_mismatch"
    assert_untouched(pool, before)


async def test_block_size_mismatch_is_refused(start_receiver: StartReceiver, sender: KvSender):
    pool = random_pool(torch.float32)  # the decode worker holds fp32 KV, the sender bf16: half the bytes
    before = pool.clone()
    receiver, reservations = await start_receiver(pool)
    reservations.reserve("reply-1", [4, 5])

    with pytest.raises(KvTransferError, match="its blocks hold 737280 bytes, ours 368640") as refused:
        await sender.send(receiver.host, receiver.port, "reply-1", list(random_pool(torch.bfloat16, 2, seed=3)), TIMEOUT_S, token=TOKEN)

    assert refused.value.reason == "size_mismatch"
    assert_untouched(pool, before)


async def test_concurrent_transfers_into_one_receiver(start_receiver: StartReceiver, sender: KvSender):
    pool = torch.zeros((NUM_POOL_BLOCKS, *BLOCK_SHAPE), dtype=torch.bfloat16)
    receiver, reservations = await start_receiver(pool)
    plan = {"reply-a": [0, 20, 40, 60], "reply-b": [1, 21, 41], "reply-c": [2, 22, 42, 62, 5]}
    sources = {reply_id: random_pool(torch.bfloat16, len(ids), seed=i) for i, (reply_id, ids) in enumerate(plan.items())}
    for reply_id, block_ids in plan.items():
        reservations.reserve(reply_id, block_ids)
    other_sender = KvSender()  # a second prefill worker: its own connection

    try:
        await asyncio.gather(
            sender.send(receiver.host, receiver.port, "reply-a", list(sources["reply-a"]), TIMEOUT_S, token=TOKEN),
            sender.send(receiver.host, receiver.port, "reply-b", list(sources["reply-b"]), TIMEOUT_S, token=TOKEN),  # same connection
            other_sender.send(receiver.host, receiver.port, "reply-c", list(sources["reply-c"]), TIMEOUT_S, token=TOKEN),
        )
    finally:
        await other_sender.close()

    for reply_id, block_ids in plan.items():
        assert await receiver.wait_received(reply_id, timeout_s=0)
        assert same_bytes(pool[block_ids], sources[reply_id])
    written = {b for ids in plan.values() for b in ids}
    assert not pool[[b for b in range(NUM_POOL_BLOCKS) if b not in written]].any()


async def test_wait_received_times_out_for_a_reply_that_never_arrives(start_receiver: StartReceiver):
    receiver, reservations = await start_receiver(random_pool(torch.bfloat16, 4))
    reservations.reserve("reply-1", [0, 1])

    started = time.monotonic()
    assert not await receiver.wait_received("reply-1", timeout_s=0.2)
    assert time.monotonic() - started >= 0.2


async def test_the_receiver_keeps_serving_after_refusals(start_receiver: StartReceiver, sender: KvSender):
    pool = random_pool(torch.bfloat16)
    receiver, reservations = await start_receiver(pool)
    reservations.reserve("reply-1", [10, 11])
    blocks = list(random_pool(torch.bfloat16, 2, seed=5))

    for wrong in (dict(reply_id="reply-2", blocks=blocks), dict(reply_id="reply-1", blocks=blocks[:1])):
        with pytest.raises(KvTransferError):
            await sender.send(receiver.host, receiver.port, timeout_s=TIMEOUT_S, **wrong, token=TOKEN)
    async with RawSender(receiver) as raw:  # a header of another protocol version
        header = wire.Header(1, "reply-1", 2, wire.nbytes(blocks[0]), TOKEN).pack()
        header[4] = 99
        assert await raw.request(header, transfer_id=1) == Status.BAD_HEADER
    await sender.send(receiver.host, receiver.port, "reply-1", blocks, TIMEOUT_S, token=TOKEN)

    assert await receiver.wait_received("reply-1", timeout_s=0)
    assert same_bytes(pool[[10, 11]], torch.stack(blocks))


async def test_a_sender_vanishing_mid_transfer_never_completes_the_reply(start_receiver: StartReceiver, sender: KvSender):
    pool = random_pool(torch.bfloat16)
    receiver, reservations = await start_receiver(pool)
    reservations.reserve("reply-1", [10, 11, 12, 13])
    reservations.reserve("reply-2", [20, 21])
    blocks = list(random_pool(torch.bfloat16, 4, seed=5))

    async with RawSender(receiver) as raw:
        header = wire.Header(1, "reply-1", 4, wire.nbytes(blocks[0]), TOKEN).pack()
        assert await raw.request(header, transfer_id=1) == Status.OK
        await raw.send_blocks(1, blocks[:2])
    # the raw sender is gone, two blocks short

    assert not await receiver.wait_received("reply-1", timeout_s=0.5)
    await sender.send(receiver.host, receiver.port, "reply-2", blocks[:2], TIMEOUT_S, token=TOKEN)
    assert await receiver.wait_received("reply-2", timeout_s=0)
    await send_once_no_longer_in_flight(sender, receiver, "reply-1", blocks)  # a retry of the same reply succeeds
    assert same_bytes(pool[[10, 11, 12, 13]], torch.stack(blocks))


async def test_forget_stops_a_transfer_so_no_late_byte_lands(start_receiver: StartReceiver):
    pool = random_pool(torch.bfloat16)
    before = pool.clone()
    receiver, reservations = await start_receiver(pool)
    reservations.reserve("reply-1", [10, 11, 12, 13])
    blocks = list(random_pool(torch.bfloat16, 4, seed=5))

    async with RawSender(receiver) as raw:
        header = wire.Header(1, "reply-1", 4, wire.nbytes(blocks[0]), TOKEN).pack()
        assert await raw.request(header, transfer_id=1) == Status.OK
        await raw.send_blocks(1, blocks[:2])
        receiver.forget("reply-1")  # released while arriving: the blocks go back to the pool
        with pytest.raises(Exception):  # noqa: B017 - whichever UCX error says the connection is gone
            await asyncio.wait_for(raw.send_blocks(1, blocks[2:], first_index=2), TIMEOUT_S)

    assert same_bytes(pool[[12, 13]], before[[12, 13]])
    assert_untouched(pool, before, [10, 11])
    assert not await receiver.wait_received("reply-1", timeout_s=0.05)


async def test_a_receiver_that_never_answers_is_a_timeout(ucx: None, sender: KvSender):
    connected = asyncio.Event()
    release = asyncio.Event()

    async def silent(endpoint) -> None:  # accepts the connection, never reads the header
        connected.set()
        await release.wait()
        endpoint.abort()

    listener = ucxx.create_listener(silent, port=0)
    try:
        started = time.monotonic()
        with pytest.raises(KvTransferError, match="timed out after 0.5 s") as failed:
            await sender.send(HOST, listener.port, "reply-1", list(random_pool(torch.bfloat16, 2)), timeout_s=0.5, token=TOKEN)
        assert failed.value.reason == "timeout"
        assert connected.is_set() and time.monotonic() - started >= 0.5
    finally:
        release.set()
        while listener.active_clients:
            await asyncio.sleep(0.001)
        listener.close()


async def test_an_unreachable_receiver_is_a_transfer_error(ucx: None, sender: KvSender):
    with pytest.raises(KvTransferError) as failed:
        await sender.send(HOST, free_port(), "reply-1", list(random_pool(torch.bfloat16, 1)), timeout_s=1, token=TOKEN)
    assert failed.value.reason in ("peer_gone", "timeout")


async def send_once_no_longer_in_flight(sender: KvSender, receiver: KvReceiver, reply_id: str, blocks: list[torch.Tensor]):
    """The receiver notices a vanished sender when UCX reports its connection gone; until then a
    retry of the same reply is refused as still in flight."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            await sender.send(receiver.host, receiver.port, reply_id, blocks, TIMEOUT_S, token=TOKEN)
            return
        except KvTransferError as exc:
            if exc.reason != "in_flight" or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)


class RawSender:
    """A sender that speaks the wire protocol step by step, to misbehave on purpose."""

    def __init__(self, receiver: KvReceiver) -> None:
        self._receiver = receiver
        self.endpoint = None

    async def __aenter__(self) -> RawSender:
        self.endpoint = await ucxx.create_endpoint(self._receiver.host, self._receiver.port)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.endpoint.abort()
        self.endpoint = None

    async def request(self, header: np.ndarray, transfer_id: int) -> Status:
        await self.endpoint.send(header, tag=wire.HEADER_TAG)
        verdict = np.empty(wire.STATUS_BYTES, np.uint8)
        await self.endpoint.recv(verdict, tag=wire.tag(Kind.VERDICT, transfer_id))
        return Reply.unpack(verdict).status

    async def send_blocks(self, transfer_id: int, blocks: list[torch.Tensor], first_index: int = 0) -> None:
        for i, block in enumerate(blocks, start=first_index):
            await self.endpoint.send(wire.as_buffer(block), tag=wire.tag(Kind.BLOCK, transfer_id, i))


async def test_a_paced_sender_keeps_to_its_rate_and_every_byte_still_lands(start_receiver: StartReceiver, ucx: None):
    prefill_pool = random_pool(torch.bfloat16, seed=1)
    pool = torch.zeros_like(prefill_pool)
    receiver, reservations = await start_receiver(pool)
    source_ids, dest_ids = [1, 2, 3, 4, 5, 6], [50, 51, 7, 8, 20, 33]
    reservations.reserve("reply-paced", dest_ids)
    bytes_per_block = wire.nbytes(prefill_pool[0])
    paced = KvSender(max_bytes_per_s=10 * bytes_per_block)  # ten blocks a second
    started_s = time.monotonic()
    try:
        await paced.send(receiver.host, receiver.port, "reply-paced", [prefill_pool[b] for b in source_ids], TIMEOUT_S, token=TOKEN)
    finally:
        await paced.close()
    # Block i starts no earlier than i / 10 s after the first: the last one at 0.5 s.
    assert time.monotonic() - started_s >= 0.5
    for source, dest in zip(source_ids, dest_ids):
        assert same_bytes(pool[dest], prefill_pool[source])


async def test_a_connection_the_receiver_aborted_does_not_fail_the_next_send(start_receiver: StartReceiver, sender: KvSender):
    pool = random_pool(torch.bfloat16)
    receiver, reservations = await start_receiver(pool)
    source = list(random_pool(torch.bfloat16, 2, seed=9))
    reservations.reserve("reply-1", [1, 2])
    await sender.send(receiver.host, receiver.port, "reply-1", source, TIMEOUT_S, token=TOKEN)
    # What forget() does to a connection whose transfer it drops, here to the one the sender keeps.
    for endpoint in list(receiver._connections):
        endpoint.abort()
    reservations.reserve("reply-2", [5, 6])
    await sender.send(receiver.host, receiver.port, "reply-2", source, TIMEOUT_S, token=TOKEN)
    assert await receiver.wait_received("reply-2", timeout_s=0)
    assert same_bytes(pool[[5, 6]], torch.stack(source))


async def test_a_connection_left_open_between_transfers_costs_little_cpu(start_receiver: StartReceiver, sender: KvSender):
    """The sender keeps its connection for the next transfer. A header receive left posted on it is
    awaited by ucxx polling on every loop turn: this process (both ends) used a whole core over an
    idle second (1.03 s measured). The receiver probes for the next header instead. The idle
    second is measured against one before any connection, since in a full run threads and tasks
    left by earlier tests take their share of this process's CPU in both (0.26 s once)."""
    pool = random_pool(torch.bfloat16)
    receiver, reservations = await start_receiver(pool)
    baseline_s, _ = await cpu_over_idle_second()
    for reply_id, block_ids in (("reply-1", [1, 2]), ("reply-2", [3, 4])):  # the second reuses the connection
        reservations.reserve(reply_id, block_ids)
        await sender.send(receiver.host, receiver.port, reply_id, list(random_pool(torch.bfloat16, 2, seed=3)), TIMEOUT_S, token=TOKEN)
        assert await receiver.wait_received(reply_id, timeout_s=0)

    cpu_s, wall_s = await cpu_over_idle_second()  # nothing to wait for, the connection idle
    assert cpu_s - baseline_s < 0.25 * wall_s, (
        f"{cpu_s:.2f} s of CPU over {wall_s:.2f} s idle, {baseline_s:.2f} before connecting: something polls"
    )
    assert cpu_s < 0.6 * wall_s, f"{cpu_s:.2f} s of CPU over {wall_s:.2f} s idle: something polls, with or without a connection"


async def cpu_over_idle_second() -> tuple[float, float]:
    """This process's CPU seconds over one second of awaiting nothing, and the second's length."""
    cpu_before_s, wall_before_s = time.process_time(), time.perf_counter()
    await asyncio.sleep(1.0)
    return time.process_time() - cpu_before_s, time.perf_counter() - wall_before_s
