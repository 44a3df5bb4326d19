"""Tensor parallelism: which part of a model a rank holds (Shard), and what ranks say to each other
(TensorParallel). One process per rank; rank 0 schedules and broadcasts each step's inputs.

A rank holds
- its share of the attention heads: q heads [r * H/N, (r+1) * H/N), and the KV heads those read
  (KV/N of them; where N exceeds the KV heads, each KV head is replicated on N/KV ranks);
- its share of the MLP's intermediate rows;
- its share of the vocabulary, ceil(V/N) rows of the embedding and of the LM head (the last
  rank's padded with zero rows);
- the norms whole.
So qkv and gate_up are column-parallel (their output rows split), o_proj and down_proj row-parallel
(their input columns split): one all-reduce after attention and one after the MLP; the embedding
lookup is an all-reduce of the rows each rank has, the logits an all-gather of each rank's columns.

Two process groups, as vLLM keeps them: the device group for the activations' collectives (gloo on
a CPU, NCCL on GPUs) and a gloo group on the CPU for the step's inputs, which are Python objects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.errors import StartupError
from tandem.models.config import ModelConfig
from tandem.models.files import ModelFile
from tandem.models.gguf_weights import read_gguf
from tandem.models.safetensors_weights import read_hf_config

# A rank waits for rank 0's next step as long as the engine is idle: a collective timeout would end
# an idle group. A dead rank is seen at once (its sockets close), not by this timeout.
IDLE_TIMEOUT = timedelta(days=365)
JOIN_TIMEOUT = timedelta(minutes=5)  # every rank loaded torch and joined: a slow machine's start, not a step


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: the slices of a model it holds (module docstring)."""

    rank: int = 0
    size: int = 1

    def check(self, config: ModelConfig) -> None:
        """A StartupError naming the setting when `config` does not split over `size` ranks."""
        n = self.size
        problems = []
        if config.num_heads % n:
            problems.append(f"{config.num_heads} attention heads")
        if config.num_kv_heads % n and n % config.num_kv_heads:
            problems.append(f"{config.num_kv_heads} KV heads (neither divides the other)")
        if config.intermediate_size % n:
            problems.append(f"an MLP of {config.intermediate_size} rows")
        if problems:
            raise StartupError(
                f"TANDEM_TENSOR_PARALLEL_SIZE={n} does not split this model's {', '.join(problems)} evenly over {n} ranks; "
                f"use a size that divides {config.num_heads} and {config.intermediate_size}"
            )

    def q_heads(self, config: ModelConfig) -> tuple[int, int]:
        per = config.num_heads // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        if config.num_kv_heads >= self.size:
            per = config.num_kv_heads // self.size
            return self.rank * per, (self.rank + 1) * per
        head = self.rank // (self.size // config.num_kv_heads)  # replicated over size / num_kv_heads ranks
        return head, head + 1

    def intermediate(self, config: ModelConfig) -> tuple[int, int]:
        per = config.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab_rows(self, config: ModelConfig) -> int:
        """Rows of this rank's embedding and LM head (every rank's alike: the last one's padded)."""
        return math.ceil(config.vocab_size / self.size)

    def vocab(self, config: ModelConfig) -> tuple[int, int]:
        """The token ids whose rows this rank holds (the last rank's may be fewer than vocab_rows)."""
        per = self.vocab_rows(config)
        return min(config.vocab_size, self.rank * per), min(config.vocab_size, (self.rank + 1) * per)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of the model this rank runs: its heads and MLP rows (vocab_size stays the
        model's: token ids are the whole vocabulary's)."""
        if self.size == 1:
            return config
        self.check(config)
        q0, q1 = self.q_heads(config)
        k0, k1 = self.kv_heads(config)
        m0, m1 = self.intermediate(config)
        return dataclasses.replace(config, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=m1 - m0)


def check_split(model: ModelFile, size: int) -> None:
    """A StartupError (Shard.check's) when `model` does not split over `size` ranks, read from its
    header before any rank starts: else each would fail at its load, and a worker restart for ever."""
    if size == 1:
        return
    config = read_gguf(model.path).config() if model.format == "gguf" else read_hf_config(model.path)
    Shard(size=size).check(config)


class TensorParallel:
    """This rank's shard and its groups; with one rank every collective is the identity."""

    def __init__(self, shard: Shard = Shard(), device_group: Any = None, cpu_group: Any = None) -> None:
        self.shard = shard
        self._device_group = device_group
        self._cpu_group = cpu_group

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place. On a CPU it is gathered and summed here in rank
        order, in float32, rounded once: gloo's ring sums each chunk of a tensor starting at a
        different rank, and where the chunks fall depends on the tensor's size, so a row's bits would
        depend on the rows batched with it (and a continuation on another worker could part from the
        uninterrupted answer). NCCL's all-reduce on GPUs as it is."""
        if self.size == 1:
            return x
        if x.is_cuda:
            dist.all_reduce(x, group=self._device_group)
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self._device_group)
        total = parts[0].float()
        for part in parts[1:]:
            total += part
        return x.copy_(total)

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, c) on every rank -> (rows, size * c), rank 0's columns first."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self._device_group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj: object = None) -> Any:
        """Rank 0's `obj` on every rank (a step's inputs: tensors travel pickled, on the CPU)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._cpu_group)
        return box[0]

    def min_int(self, value: int) -> int:
        """The least of every rank's `value` (a KV cache's blocks: every rank holds as many)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._cpu_group)
        return int(t.item())

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


SINGLE = TensorParallel()


def join(rank: int, size: int, rendezvous: str, device: str) -> TensorParallel:
    """Joins the group of `size` ranks meeting at `rendezvous` (a file:// or tcp:// URL) as `rank`:
    gloo on a CPU, NCCL on GPUs for the activations; gloo for the step's inputs either way."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device == "cuda" else "gloo"
    # The ranks of one engine share a host: gloo's sockets stay on its loopback unless told otherwise.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    with _stdout_to_stderr():  # gloo says it connected on stdout, which `tandem generate` keeps for the answer
        # Meeting is bounded (a rank that died before it joined fails the others); the groups the
        # steps use then wait as long as the engine idles.
        dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=size, timeout=JOIN_TIMEOUT)
        device_group = dist.new_group(backend=backend, timeout=IDLE_TIMEOUT)
        cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TensorParallel(Shard(rank, size), device_group, cpu_group)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 pointed at 2 for the block (what C++ code prints goes to stderr too)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
