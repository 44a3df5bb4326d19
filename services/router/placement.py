"""Which decode worker runs a reply: the lowest cost wins; among equal costs a rendezvous
(highest-random-weight) hash of the conversation keeps a conversation on the same worker, so its
next turn finds its prefix cached there, and spreads different conversations evenly.

Pure: the ranking depends only on the workers' numbers and the key, never on the order the
registry lists them in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.router.workers import LiveWorker
from tandem import model_ids
from tandem.v1.common_pb2 import LaneCounts
from tandem.v1.generate_pb2 import GenerateRequest

# Costs closer than this are equal: they come from the same integers, only divided.
_FLOAT_EPSILON = 1e-9


@dataclass(frozen=True)
class PlacementConfig:
    # Prefill tokens that weigh as much as one running or waiting reply.
    prefill_tokens_per_unit: int = 512
    # Costs within this of the best count as tied, so affinity beats a slightly lower load.
    tie_slack: float = 0.0
    # Uncached prompt tokens above which a prefill worker reads the prompt (a follow-up turn
    # whose uncached part is short prefills on its decode worker).
    remote_prefill_min_tokens: int = 256


CachedTokens = Callable[[LiveWorker, GenerateRequest], int]


def no_cached_tokens(worker: LiveWorker, request: GenerateRequest) -> int:
    """The seam for KV-prefix-aware placement: how many of the request's leading tokens `worker`
    holds in its prefix cache. Nothing is known until the router indexes KV events."""
    return 0


def num_context_tokens(request: GenerateRequest) -> int:
    """Tokens the worker must prefill: the prompt, plus what a continuation already generated."""
    return len(request.prompt_token_ids) + len(request.generated_token_ids)


def affinity_key(request: GenerateRequest, reply_id: str) -> str:
    """What the rendezvous hash keeps together: the conversation, else just this reply."""
    return request.conversation_id or reply_id


def rendezvous_weight(key: str, instance_id: str) -> int:
    """Stable across processes and restarts (unlike Python's salted hash())."""
    digest = hashlib.blake2b(f"{key}\x00{instance_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _num_replies(counts: LaneCounts) -> int:
    return counts.paid + counts.free + counts.background


class Placement:
    def __init__(self, config: PlacementConfig = PlacementConfig(), cached_tokens: CachedTokens = no_cached_tokens) -> None:
        self._config = config
        self._cached_tokens = cached_tokens

    def load(self, worker: LiveWorker) -> float:
        """Replies it holds (its last heartbeat's, plus what this router sent since) and its
        queued prefill work, in reply-equivalents."""
        heartbeat = worker.heartbeat
        num_replies = _num_replies(heartbeat.running) + _num_replies(heartbeat.waiting) + worker.num_assigned
        num_queued_tokens = heartbeat.queued_prefill_tokens + worker.num_assigned_prompt_tokens
        return num_replies + num_queued_tokens / self._config.prefill_tokens_per_unit

    def num_uncached_tokens(self, worker: LiveWorker, request: GenerateRequest) -> int:
        """The request's tokens `worker` would prefill: those its prefix cache does not hold."""
        return max(0, num_context_tokens(request) - self._cached_tokens(worker, request))

    def cost(self, worker: LiveWorker, request: GenerateRequest) -> float:
        """Its load plus this request's uncached prefill (the same on every worker until
        `cached_tokens` knows better)."""
        return self.load(worker) + self.num_uncached_tokens(worker, request) / self._config.prefill_tokens_per_unit

    def should_prefill_remotely(self, decode_worker: LiveWorker, request: GenerateRequest) -> bool:
        return self.num_uncached_tokens(decode_worker, request) > self._config.remote_prefill_min_tokens

    def rank(self, workers: Sequence[LiveWorker], model: str, request: GenerateRequest, key: str) -> list[LiveWorker]:
        """Workers that serve `model` and take work, best first."""
        scored = [(self.cost(w, request), rendezvous_weight(key, w.instance_id), w) for w in workers if can_serve(w, model)]
        scored.sort(key=lambda entry: (entry[0], -entry[1]))
        ranked: list[LiveWorker] = []
        while scored:
            # The cheapest and everything within the slack of it form one tier; affinity orders a tier.
            limit = scored[0][0] + self._config.tie_slack + _FLOAT_EPSILON
            tier = [entry for entry in scored if entry[0] <= limit]
            scored = [entry for entry in scored if entry[0] > limit]
            ranked.extend(w for _, _, w in sorted(tier, key=lambda entry: -entry[1]))
        return ranked

    def reason(self, ranked: Sequence[LiveWorker], request: GenerateRequest) -> str:
        """Why the first of `ranked` (rank's order, perhaps reordered for the lane) was chosen, for
        the placement metric: cache_hit, only_worker, lane, rendezvous or load."""
        chosen, others = ranked[0], ranked[1:]
        if self._cached_tokens(chosen, request) > 0:
            return "cache_hit"
        if not others:
            return "only_worker"
        cost = self.cost(chosen, request)
        cheapest_other = min(self.cost(w, request) for w in others)
        if cheapest_other < cost - _FLOAT_EPSILON:
            return "lane"
        return "rendezvous" if cheapest_other <= cost + self._config.tie_slack + _FLOAT_EPSILON else "load"


def can_serve(worker: LiveWorker, model: str) -> bool:
    return worker.is_serving and worker.model == model


def serves_name(worker: LiveWorker, name: str) -> bool:
    """It takes work for some version of the model `name` (or for the unversioned model)."""
    return worker.is_serving and model_ids.name_of(worker.model) == name
