"""How many KV blocks an engine holds and the longest sequence it serves, sized as vLLM sizes them.

The first of these that is given sets the KV cache's size (EngineConfig):
- num_kv_blocks: that many blocks;
- kv_cache_mib: that many MiB (TANDEM_KV_CACHE_MIB, an explicit override);
- gpu_memory_utilization, or a GPU (0.9 there): that share of the device's memory (a GPU's total;
  a CPU's RAM, or its cgroup's limit where lower, split over the tensor-parallel ranks, which share
  one host's RAM), less this rank's weights and the activation peak of a profiled step (on a GPU
  that share must be free at start, or this process's already, as vLLM checks);
- else, on a CPU: 1024 MiB.

The profiled step is the largest the scheduler plans: a step of prompts alone, its
max_num_prefill_only_tokens (at least max_num_batched_tokens) dummy prompt tokens (one sequence,
or several of max_model_len where that is shorter) in one forward, then the logits of
max_num_seqs rows. Its peak above what was held before it is the activations': on a GPU torch's
allocator says it; on a CPU the process's peak resident memory (VmHWM, reset first through
/proc/self/clear_refs).

Under tensor parallelism every rank calls plan_kv_cache at the same point, with the same
configuration: the profiled forward's collectives meet, and the ranks take the least of their block
counts, so each rank's cache holds as many blocks (of its own KV heads).
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from tandem.engine.engine_config import EngineConfig
from tandem.engine.runner import Rows, build_inputs
from tandem.engine.sequence import Sequence
from tandem.errors import StartupError
from tandem.models.config import ModelConfig
from tandem.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_MIB = 1024
GPU_DEFAULT_UTILIZATION = 0.9

# Where a CPU's memory may be limited below the machine's RAM: cgroup v2's, then v1's limit.
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


class BudgetSource(Enum):
    """What set the KV cache's size; the value names it for the operator."""

    NUM_KV_BLOCKS = "num_kv_blocks"
    KV_CACHE_MIB = "TANDEM_KV_CACHE_MIB"
    UTILIZATION = "TANDEM_GPU_MEMORY_UTILIZATION"
    CPU_DEFAULT = f"the CPU default of {CPU_DEFAULT_KV_CACHE_MIB} MiB"


@dataclass(frozen=True)
class KvBudget:
    """The bytes the KV cache may take and the figures they came from. Under a utilization,
    kv_bytes == int(utilization * total_bytes) - weights_bytes - activation_bytes; elsewhere
    only kv_bytes is known and the figures are 0."""

    source: BudgetSource
    kv_bytes: int
    utilization: float = 0.0
    total_bytes: int = 0  # the device's memory (on a CPU this rank's share of it)
    weights_bytes: int = 0  # this rank's parameters and buffers
    activation_bytes: int = 0  # the profiled step's peak

    def describe(self) -> str:
        if self.source is BudgetSource.UTILIZATION:
            return (
                f"{self.source.value} {self.utilization:g}: total {_size(self.total_bytes)}, weights {_size(self.weights_bytes)}, "
                f"activations {_size(self.activation_bytes)}, KV {_size(self.kv_bytes)}"
            )
        return f"{self.source.value}: {_size(self.kv_bytes)}"


@dataclass(frozen=True)
class KvPlan:
    """A rank's KV cache: its blocks (every rank of a group holds as many) and the longest sequence served."""

    num_blocks: int
    block_size: int
    max_model_len: int
    bytes_per_block: int
    budget: KvBudget

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.num_tokens / self.max_model_len:.2f} sequences of max_model_len {self.max_model_len} "
            f"(budget from {self.budget.describe()})"
        )


def plan_kv_cache(model: LlamaForCausalLM, config: EngineConfig, cache_dtype: torch.dtype, device: torch.device) -> KvPlan:
    """The KV cache `model` (this rank's) gets on `device`, and the max_model_len it serves; a
    StartupError naming the setting to change where one max_model_len sequence does not fit.
    Under tensor parallelism every rank calls it at the same point (module docstring)."""
    window = model.config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > window:
        raise StartupError(f"TANDEM_MAX_MODEL_LEN={config.max_model_len} is longer than the model's {window}-token context window")
    bytes_per_block = kv_bytes_per_block(model.config, config.block_size, cache_dtype)
    budget = kv_budget(model, config, cache_dtype, torch.device(device))
    if budget.source is BudgetSource.NUM_KV_BLOCKS:
        num_blocks = config.num_kv_blocks or 0
    elif budget.source is BudgetSource.UTILIZATION:
        num_blocks = max(0, budget.kv_bytes // bytes_per_block)
    else:
        num_blocks = max(1, budget.kv_bytes // bytes_per_block)
    num_blocks = model.tp.min_int(num_blocks)
    max_model_len = _fit_max_model_len(config, window, num_blocks, budget)
    plan = KvPlan(num_blocks, config.block_size, max_model_len, bytes_per_block, budget)
    group = f"; blocks: the least of {model.tp.size} ranks' counts, the figures rank {model.tp.rank}'s" if model.tp.size > 1 else ""
    log.log(logging.INFO if model.tp.rank == 0 else logging.DEBUG, plan.describe() + group)
    return plan


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens, of the KV heads `config` (a rank's) holds."""
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


def kv_budget(model: LlamaForCausalLM, config: EngineConfig, cache_dtype: torch.dtype, device: torch.device) -> KvBudget:
    """The bytes the KV cache may take, by the first rule given (module docstring)."""
    if config.num_kv_blocks is not None:
        bytes_per_block = kv_bytes_per_block(model.config, config.block_size, cache_dtype)
        return KvBudget(BudgetSource.NUM_KV_BLOCKS, config.num_kv_blocks * bytes_per_block)
    if config.kv_cache_mib is not None:
        return KvBudget(BudgetSource.KV_CACHE_MIB, config.kv_cache_mib * 2**20)
    utilization = config.gpu_memory_utilization or (GPU_DEFAULT_UTILIZATION if device.type == "cuda" else None)
    if utilization is None:
        return KvBudget(BudgetSource.CPU_DEFAULT, CPU_DEFAULT_KV_CACHE_MIB * 2**20)
    total = device_memory_bytes(device, model.tp.size)
    if device.type == "cuda":
        _check_gpu_is_free_enough(device, utilization, total)
    weights = weights_bytes(model)
    max_model_len = config.max_model_len or model.config.max_position_embeddings
    activations = profile_activation_bytes(model, config, cache_dtype, device, max_model_len)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the profile's scratch and activations: the KV cache, one large tensor, is allocated next
    kv_bytes = int(utilization * total) - weights - activations
    return KvBudget(BudgetSource.UTILIZATION, kv_bytes, utilization, total, weights, activations)


def _fit_max_model_len(config: EngineConfig, window: int, num_blocks: int, budget: KvBudget) -> int:
    """The max_model_len served: the one given, else the model's window, capped to what one
    sequence can hold where the cache's size was given outright (blocks, MiB, the CPU default)."""
    # A sequence holds the blocks above the scheduler's reserve (engine/scheduler.py).
    capacity = max(0, (num_blocks - config.num_reserved_blocks) * config.block_size)
    wanted = config.max_model_len or window
    if wanted <= capacity:
        return wanted
    if config.max_model_len is None and budget.source is not BudgetSource.UTILIZATION and capacity > 0:
        # Blocks given outright are a test's or a bench's sizing: the start-up line says the length, no warning.
        level = logging.DEBUG if budget.source is BudgetSource.NUM_KV_BLOCKS else logging.WARNING
        log.log(
            level,
            "max_model_len capped to %d tokens, what one sequence can hold in the KV cache (budget from %s), below the model's "
            "%d-token context window; raise TANDEM_KV_CACHE_MIB for longer sequences, or set TANDEM_MAX_MODEL_LEN (at most %d) to choose the length",
            capacity,
            budget.describe(),
            window,
            capacity,
        )
        return capacity
    which = "" if config.max_model_len else " (the model's context window)"
    raise StartupError(
        f"the KV cache holds {capacity} tokens per sequence ({num_blocks} blocks of {config.block_size} tokens, "
        f"{config.num_reserved_blocks} of them kept in reserve; budget from {budget.describe()}), fewer than max_model_len "
        f"{wanted}{which}: raise TANDEM_GPU_MEMORY_UTILIZATION "
        "or TANDEM_KV_CACHE_MIB, or lower TANDEM_MAX_MODEL_LEN"
    )


def device_memory_bytes(device: torch.device, tp_size: int = 1) -> int:
    """A GPU's total memory; a CPU's RAM (its cgroup's limit where lower) over the `tp_size` ranks
    that share it."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    total = _proc_bytes(Path("/proc/meminfo"), "MemTotal")
    for path in CGROUP_LIMITS:
        try:
            limit = path.read_text().strip()
        except OSError:
            continue
        if limit.isdigit():  # "max" (v2) or a huge number (v1) where there is no limit
            total = min(total, int(limit))
    return total // tp_size


def _check_gpu_is_free_enough(device: torch.device, utilization: float, total: int) -> None:
    """vLLM's check: the share asked for must be free now, or held by this process (its weights),
    else other processes hold part of it and the KV cache would not fit."""
    free, _ = torch.cuda.mem_get_info(device)
    available = free + torch.cuda.memory_reserved(device)
    if available < utilization * total:
        raise StartupError(
            f"TANDEM_GPU_MEMORY_UTILIZATION={utilization:g} asks for {_size(int(utilization * total))} of the GPU's {_size(total)}, "
            f"but only {_size(available)} is free or this process's (other processes hold the rest): lower it, or set TANDEM_KV_CACHE_MIB"
        )


def weights_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters and buffers, each storage once (tied weights, views)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@torch.inference_mode()
def profile_activation_bytes(
    model: LlamaForCausalLM, config: EngineConfig, cache_dtype: torch.dtype, device: torch.device, max_model_len: int
) -> int:
    """The peak memory of the largest step above what was held before it: a forward of
    max_num_prefill_only_tokens prompt tokens, then max_num_seqs rows' logits, over a scratch KV cache
    (allocated before, so not counted) of blocks enough for those tokens. The same calls on every rank."""
    num_tokens = config.prefill_only_tokens_on(device.type)  # at least the step budget
    lengths = [max_model_len] * (num_tokens // max_model_len) + ([num_tokens % max_model_len] if num_tokens % max_model_len else [])
    rows, num_blocks = [], 0
    for i, length in enumerate(lengths):
        seq = Sequence(f"profile-{i}", [0] * length)
        seq.append_blocks(range(num_blocks, num_blocks + math.ceil(length / config.block_size)))
        num_blocks += len(seq.block_table)
        rows.append(Rows(seq, 0, length, is_sampled=True))
    c = model.config
    kv_cache = torch.zeros((num_blocks, c.num_layers, 2, config.block_size, c.num_kv_heads, c.head_dim), dtype=cache_dtype, device=device)
    inputs = build_inputs(rows, config.block_size, device)
    num_rows = min(config.max_num_seqs, num_tokens)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        hidden = model(inputs.input_ids, inputs.positions, kv_cache, inputs.meta)
        return hidden, model.compute_logits(hidden[:num_rows])

    return _gpu_peak_bytes(device, step) if device.type == "cuda" else cpu_peak_bytes(step)


def _gpu_peak_bytes(device: torch.device, step: Callable[[], object]) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def cpu_peak_bytes(step: Callable[[], object]) -> int:
    """The process's peak resident memory while `step` runs, above what it held before."""
    gc.collect()
    status = Path("/proc/self/status")
    try:  # "5" resets the peak resident set (VmHWM) to the current one (proc(5), clear_refs)
        Path("/proc/self/clear_refs").write_text("5")
        peak_field = "VmHWM"
    except OSError as exc:
        log.debug("the peak resident memory cannot be reset (%s): activations measured as VmRSS after the step less before", exc)
        peak_field = "VmRSS"
    before = _proc_bytes(status, "VmRSS")
    outputs = step()  # held while the peak is read: the fallback's VmRSS counts them at least
    peak = _proc_bytes(status, peak_field)
    del outputs
    return max(0, peak - before)


def _proc_bytes(path: Path, field: str) -> int:
    """A "<field>: <n> kB" line of a /proc file, in bytes."""
    for line in path.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    raise StartupError(f"{path} has no {field} line: this host's memory cannot be read")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if abs(num_bytes) >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
