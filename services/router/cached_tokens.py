"""Placement's `cached_tokens` seam, answered from the prefix index: how many leading tokens of a
request a worker's prefix cache holds, by the block keys that worker's engine will compute.

The keys follow the engine's rules exactly (tandem.worker.wire.engine_request, the KV cache
manager): tenant = request.tenant or request.user_id; blocks wholly inside the public prefix use
the public namespace; only full blocks count; and at least one token is always left to compute,
so a prompt's last token's block never counts as cached.
"""

from __future__ import annotations

from services.router.prefix_index import PrefixIndex
from services.router.workers import LiveWorker
from tandem.engine.block_hash import prefix_block_hashes
from tandem.kv_blocks import BLOCK_SIZE
from tandem.v1.generate_pb2 import GenerateRequest


def request_block_hashes(request: GenerateRequest, block_size: int) -> list[int]:
    """The keys of the blocks the engine could find cached for this request, in order.

    The context is the prompt plus what a continuation already generated: the tokens the worker
    prefills, as placement counts them."""
    token_ids = [*request.prompt_token_ids, *request.generated_token_ids]
    return prefix_block_hashes(
        token_ids,
        tenant=request.tenant or request.user_id,
        num_public_prefix_tokens=min(request.public_prefix_tokens, len(request.prompt_token_ids)),
        block_size=block_size,
        num_blocks=max(0, len(token_ids) - 1) // block_size,
    )


class IndexedCachedTokens:
    """`cached_tokens(worker, request)` for Placement. Ranking asks once per worker for the same
    request, so the request's keys are computed once and kept until the next request (a parsed
    request is never changed)."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self._last: tuple[GenerateRequest, int, list[int]] | None = None

    def __call__(self, worker: LiveWorker, request: GenerateRequest) -> int:
        block_size = worker.heartbeat.kv_block_size or BLOCK_SIZE
        block_hashes = self._block_hashes(request, block_size)
        return block_size * self._index.num_prefix_blocks(worker.instance_id, block_hashes)

    def _block_hashes(self, request: GenerateRequest, block_size: int) -> list[int]:
        if self._last is not None and self._last[0] is request and self._last[1] == block_size:
            return self._last[2]
        block_hashes = request_block_hashes(request, block_size)
        self._last = (request, block_size, block_hashes)
        return block_hashes
