"""Placement fed by the prefix index: cached tokens follow the engine's block keys (tenant,
public prefix, whole blocks, one token left to compute), the worker holding a conversation's
history wins at equal load, and a follow-up turn cached on its decode worker prefills there."""

from __future__ import annotations

from router_fakes import MODEL, decode_worker, request

from services.router.cached_tokens import IndexedCachedTokens
from services.router.dispatch import DispatchConfig
from services.router.generate import GenerateService
from services.router.placement import Placement, PlacementConfig
from services.router.prefix_index import PrefixIndex
from services.router.workers import WorkerRegistry
from tandem.engine.block_hash import prefix_block_hashes
from tandem.v1.kv_pb2 import BlocksStored, KvEvent, StoredBlock

BLOCK_SIZE = 16


async def no_state(worker_id: str):
    raise AssertionError("these tests never skip an event id")


def index_with(holdings: dict[str, list[int]]) -> PrefixIndex:
    index = PrefixIndex(no_state)
    for worker_id, hashes in holdings.items():
        blocks = [StoredBlock(block_hash=h, num_tokens=BLOCK_SIZE) for h in hashes]
        index.apply(KvEvent(worker_id=worker_id, event_id=1, stored=BlocksStored(blocks=blocks)))
    return index


def keys(token_ids, tenant: str = "t1", public: int = 0) -> list[int]:
    return prefix_block_hashes(token_ids, tenant=tenant, num_public_prefix_tokens=public, block_size=BLOCK_SIZE)


def with_block_size(worker):
    worker.heartbeat.kv_block_size = BLOCK_SIZE
    return worker


def test_cached_tokens_are_the_longest_indexed_prefix_in_whole_blocks():
    req = request(100, tenant="t1")
    held = keys(req.prompt_token_ids)  # 6 full blocks
    index = index_with({"d1": held[:3] + held[4:], "d2": held[1:]})
    cached = IndexedCachedTokens(index)
    assert cached(with_block_size(decode_worker("d1")), req) == 3 * BLOCK_SIZE  # stops at the missing 4th block
    assert cached(with_block_size(decode_worker("d2")), req) == 0  # no first block, no prefix
    assert cached(with_block_size(decode_worker("d3")), req) == 0  # nothing indexed


def test_a_fully_cached_prompt_leaves_its_last_block_to_compute():
    req = request(32, tenant="t1")
    cached = IndexedCachedTokens(index_with({"d1": keys(req.prompt_token_ids)}))
    assert cached(with_block_size(decode_worker("d1")), req) == BLOCK_SIZE  # the engine recomputes block 2
    longer = request(33, tenant="t1")
    assert cached(with_block_size(decode_worker("d1")), longer) == 2 * BLOCK_SIZE


def test_another_tenants_blocks_never_count_but_the_public_prefix_does():
    tokens = list(range(1, 65))
    index = index_with({"d1": keys(tokens, tenant="t1", public=32)})
    cached = IndexedCachedTokens(index)
    worker = with_block_size(decode_worker("d1"))
    assert cached(worker, request(64, tenant="t1", public_prefix_tokens=32)) == 48
    assert cached(worker, request(64, tenant="t2", public_prefix_tokens=32)) == 32  # the two public blocks only
    assert cached(worker, request(64, tenant="t2")) == 0  # without the public prefix, every key is t2's
    assert cached(worker, request(64, user_id="t1", public_prefix_tokens=32)) == 48  # no tenant: the user is the tenant


def test_the_worker_holding_the_prefix_wins_at_equal_load_whatever_the_conversation():
    req = request(600, tenant="t1")
    placement = Placement(cached_tokens=IndexedCachedTokens(index_with({"d2": keys(req.prompt_token_ids)})))
    workers = [with_block_size(decode_worker(f"d{i}", num_running=1)) for i in range(1, 5)]
    for key in (f"conv-{i}" for i in range(20)):
        assert [w.instance_id for w in placement.rank(workers, MODEL, req, key)][0] == "d2"


def test_a_cached_history_outweighs_a_little_more_load():
    req = request(2048, tenant="t1")
    placement = Placement(cached_tokens=IndexedCachedTokens(index_with({"d1": keys(req.prompt_token_ids)})))
    workers = [with_block_size(decode_worker("d1", num_running=2)), with_block_size(decode_worker("d2"))]
    assert [w.instance_id for w in placement.rank(workers, MODEL, req, "conv-1")] == ["d1", "d2"]
    swamped = [with_block_size(decode_worker("d1", num_running=9)), with_block_size(decode_worker("d2"))]
    assert [w.instance_id for w in placement.rank(swamped, MODEL, req, "conv-1")] == ["d2", "d1"]


def prefill_worker(instance_id: str):
    worker = with_block_size(decode_worker(instance_id))
    worker.heartbeat.service.role = "prefill"
    return worker


def test_a_long_follow_up_whose_history_is_cached_on_its_decode_worker_prefills_there():
    first_turn = list(range(1, 701))
    follow_up = request(0, tenant="t1", conversation_id="c1")
    follow_up.prompt_token_ids.extend([*first_turn, *range(2001, 2041)])  # turn 1 + reply + new message: 740 tokens
    held = keys(first_turn)  # 43 blocks = 688 tokens, on d2
    registry = WorkerRegistry()
    for worker in (with_block_size(decode_worker("d1")), with_block_size(decode_worker("d2")), prefill_worker("p1")):
        registry.observe(worker.heartbeat)
    index = index_with({"d2": held, "p1": held})
    config = PlacementConfig(remote_prefill_min_tokens=256)

    async def never(*args):
        raise AssertionError("handle() never dispatches")

    warm = GenerateService(registry, Placement(config, IndexedCachedTokens(index)), never, never, DispatchConfig())
    _, job = warm.handle(follow_up.SerializeToString())
    assert job.worker_ids[0] == "d2"
    assert job.remote is None, "52 uncached tokens prefill on the decode worker"

    cold = GenerateService(registry, Placement(config), never, never, DispatchConfig())
    _, job = cold.handle(follow_up.SerializeToString())
    assert job.remote is not None and job.remote[1] == ("p1",), "without the index all 740 look uncached"
