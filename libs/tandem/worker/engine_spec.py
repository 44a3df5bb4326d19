"""What a worker's engine is built from (EngineSpec) and the one place it is built (build_engine),
on the engine's own thread or in the engine process. The engine process imports this module, so
it imports nothing NATS-facing: the spec travels to that process pickled, and what unpickles it
must not drag the worker's bus along."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tandem.config import Settings
from tandem.engine.engine import Engine, EngineConfig, KvCacheAllocator
from tandem.engine.rank_follower import follow
from tandem.engine.repetition import RepetitionStop
from tandem.errors import StartupError
from tandem.kernels import select_attention
from tandem.kernels.gemm_choice import GemmPolicy
from tandem.models.files import ModelFile
from tandem.models.loader import LoadedModel, load_model, resolve_device, resolve_dtype, resolve_kv_cache_dtype
from tandem.models.tensor_parallel import join

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """What a worker's engine is built from."""

    model: ModelFile
    device: str
    dtype: torch.dtype
    engine: EngineConfig
    torch_threads: int = 0  # 0: torch's default (one per core of the machine)
    engine_process: bool = False  # the engine steps in a process of its own (engine_process.py), else on a thread
    log_level: str = "INFO"  # the engine process's
    tensor_parallel_size: int = 1  # ranks, one process each beside rank 0 (engine_ranks.py)
    rendezvous: str = ""  # where the ranks meet (a file:// URL), set when they are started
    cpu_gemm: GemmPolicy = "auto"  # the kernel policy for packed projections (kernels/gemm_choice.py)

    @classmethod
    def from_settings(cls, settings: Settings, model: ModelFile, role: str = "decode") -> EngineSpec:
        """Resolves the device now, so "cuda" without a GPU fails at start (StartupError). A prefill
        worker's engine captures no CUDA graphs: they serve decode steps, which it leaves to others."""
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        engine = EngineConfig(
            kv_cache_mib=settings.kv_cache_mib,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_model_len=settings.max_model_len,
            kv_cache_dtype=None if settings.kv_cache_dtype == "auto" else resolve_kv_cache_dtype(settings.kv_cache_dtype, dtype, device),
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_prefill_only_tokens=settings.max_num_prefill_only_batched_tokens,
            max_num_unpaid_tokens=settings.max_num_unpaid_batched_tokens,
            enforce_eager=settings.enforce_eager or role == "prefill",
            repetition_stop=repetition_stop(settings),
        )
        # One thread per CPU of the process's affinity unless set (torch counts the machine's cores);
        # the ranks of a tensor-parallel engine share them (of the machine's, with no affinity set).
        num_ranks = settings.tensor_parallel_size
        cpus = len(settings.cpus) or (len(os.sched_getaffinity(0)) if num_ranks > 1 else 0)
        torch_threads = settings.torch_threads or (max(1, cpus // num_ranks) if cpus else 0)
        # An engine process shares its KV cache through a memfd: a CPU's cache, on Linux.
        # The ranks of a tensor-parallel engine on a CPU share their KV caches so too (the worker reads every rank's blocks).
        wants_process = settings.engine_process or settings.tensor_parallel_size > 1
        engine_process = wants_process and device == "cpu" and hasattr(os, "memfd_create")
        if num_ranks > 1 and not engine_process and role == "prefill":
            # Its other ranks' KV blocks are on their own devices, out of the worker's reach (no CUDA IPC yet).
            raise StartupError(
                f"TANDEM_TENSOR_PARALLEL_SIZE={num_ranks}: a prefill worker on {device} hands off its KV only with one rank "
                "(tensor-parallel handoffs run on CPUs, where every rank's cache is shared memory); use 1 for prefill workers here"
            )
        return cls(
            model,
            device,
            dtype,
            engine,
            torch_threads,
            engine_process,
            settings.log_level,
            settings.tensor_parallel_size,
            cpu_gemm=settings.cpu_gemm,
        )


def repetition_stop(settings: Settings) -> RepetitionStop | None:
    """The workers' repetition stop (engine/repetition.py); None where the settings turn it off."""
    if not settings.repetition_stop_max_ngram_tokens:
        return None
    return RepetitionStop(settings.repetition_stop_max_ngram_tokens, settings.repetition_stop_repeats, settings.repetition_stop_min_tokens)


def build_engine(spec: EngineSpec, allocate_kv_cache: KvCacheAllocator | None = None) -> Engine:
    """Where the engine steps (its thread, or its process): rank 0 of a tensor-parallel engine."""
    return Engine(load_rank(spec, 0), spec.engine, allocate_kv_cache)


def follow_engine(spec: EngineSpec, rank: int, allocate_kv_cache: KvCacheAllocator | None = None) -> None:
    """Ranks 1..N-1 of a tensor-parallel engine (engine_rank.py): loads this rank's shard, then
    builds and steps what rank 0 does (engine/rank_follower.py) until rank 0 stops."""
    follow(load_rank(spec, rank), allocate_kv_cache)


def load_rank(spec: EngineSpec, rank: int) -> LoadedModel:
    """Sets torch's thread count, joins the rank's group (spec.rendezvous) and loads its shard."""
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    tp = join(rank, spec.tensor_parallel_size, spec.rendezvous, spec.device)
    loaded = load_model(
        spec.model.path, spec.dtype, spec.device, select_attention(spec.device), spec.model.quantization, tp=tp, cpu_gemm=spec.cpu_gemm
    )
    log.info(
        "engine %s: %s, %s (quantization %s) on %s with %d torch threads",
        "ready" if tp.size == 1 else f"rank {rank} of {tp.size} loaded",
        spec.model.name,
        spec.dtype,
        spec.model.quantization,
        spec.device,
        torch.get_num_threads(),
    )
    return loaded
