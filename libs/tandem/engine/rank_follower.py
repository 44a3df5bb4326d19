"""What ranks 1..N-1 of a tensor-parallel engine do once loaded: whatever rank 0 broadcasts, in its
order. An EngineConfig: rank 0 is building an engine, so this rank builds its own (the same KV
sizing, with the same collectives; its KV cache holds this rank's heads). A RankStep: one forward of
that engine. None: rank 0 stopped, and so does this rank.

Rank 0 owns everything else (the scheduler, the block tables, the prefix cache, sampling): an
engine here is only its runner and its KV cache."""

from __future__ import annotations

from tandem.engine.engine import Engine, EngineConfig, KvCacheAllocator
from tandem.engine.runner import RankStep, Runner
from tandem.models.loader import LoadedModel


def follow(loaded: LoadedModel, allocate_kv_cache: KvCacheAllocator | None = None) -> None:
    """Until rank 0 stops; a message out of order is a TypeError (the group is then broken: its
    other ranks fail in their next collective)."""
    tp = loaded.model.tp
    runner: Runner | None = None
    while (message := tp.broadcast()) is not None:
        if isinstance(message, EngineConfig):
            runner = Engine(loaded, message, allocate_kv_cache).runner
        elif isinstance(message, RankStep) and runner is not None:
            runner.compute(message)
        else:
            raise TypeError(f"rank {tp.rank} got a {type(message).__name__} from rank 0 before any engine")
