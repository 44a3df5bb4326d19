"""The engine bench's workload on our engine: the batch of requests at once, timed, and one
prompt prefilled alone, on each model variant; under tensor parallelism, on rank 0 of a group."""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable, Iterator

import torch
from common import kv_blocks_for, percentile, run_timed
from roofline import ModelCost, measure_matmul_flops

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.models.files import Quantization, open_model
from tandem.models.loader import LoadedModel, load_model
from tandem.worker.engine_ranks import PeerRanks
from tandem.worker.engine_spec import EngineSpec, load_rank


def engine_config(num_blocks: int, num_seqs: int, kv_cache_dtype: torch.dtype | None, enforce_eager: bool) -> EngineConfig:
    # max_num_seqs: every request at once, as the default would, and no CUDA graph captured for
    # a batch size the run never has
    return EngineConfig(num_kv_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype, max_num_seqs=num_seqs, enforce_eager=enforce_eager)


def run_ours(
    loaded: LoadedModel, prompts: list[list[int]], num_tokens: int, kv_cache_dtype: torch.dtype | None = None, enforce_eager: bool = False
) -> dict:
    sampling = SamplingOptions(max_tokens=num_tokens, ignore_eos=True)
    num_blocks = kv_blocks_for((len(p) + num_tokens for p in prompts), EngineConfig.block_size)
    engine = Engine(loaded, engine_config(num_blocks, len(prompts), kv_cache_dtype, enforce_eager))
    requests = [Request(f"r{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
    timings = run_timed(engine, requests)
    wrong = {rid: t.num_output_tokens for rid, t in timings.items() if t.num_output_tokens != num_tokens}
    if len(timings) != len(requests) or wrong:
        raise RuntimeError(f"expected {num_tokens} tokens from each of {len(requests)} requests; got {wrong}")
    start_s = min(t.submit_s for t in timings.values())
    elapsed_s = max(t.last_token_s for t in timings.values()) - start_s
    ordered = [timings[r.request_id] for r in requests]
    return {
        "elapsed_s": elapsed_s,
        "tokens_per_s": len(requests) * num_tokens / elapsed_s,
        "ttft_ms": [t.ttft_ms for t in ordered],
        "tpot_ms": [t.tpot_ms for t in ordered],
        "num_preemptions": engine.stats().scheduler.num_preemptions,
        "num_steps": engine.stats().num_steps,
    }


def prefill_once(loaded: LoadedModel, prompt: list[int], kv_cache_dtype: torch.dtype | None, enforce_eager: bool) -> float:
    """Seconds to the first token of `prompt` alone on a fresh engine (no cached prefix)."""
    num_blocks = kv_blocks_for([len(prompt) + 1], EngineConfig.block_size)
    engine = Engine(loaded, engine_config(num_blocks, 1, kv_cache_dtype, enforce_eager))
    timing = run_timed(engine, [Request("prefill", tuple(prompt), SamplingOptions(max_tokens=1, ignore_eos=True))])["prefill"]
    return timing.first_token_s - timing.submit_s


def prefill_against_peak(
    loaded: LoadedModel,
    prompt: list[int],
    matmul_rates: Callable[[], dict[str, float]],
    kv_cache_dtype: torch.dtype | None,
    enforce_eager: bool,
    rounds: int = 3,
) -> list[tuple[float, float, float]]:
    """(seconds to the first token, the peak matmul rate measured just before and just after it,
    the higher, and torch's matmul rate likewise) for each of `rounds` prefills: where the matrix
    unit's rate swings with the host's other load (a shared 2-vCPU Xeon measured 750 to 2,100
    GFLOP/s for the same AMX matmul within seconds), a prefill's share of peak is its rate over the
    peak of its own moment."""
    measured = []
    for _ in range(rounds):
        before = matmul_rates()
        seconds = prefill_once(loaded, prompt, kv_cache_dtype, enforce_eager)
        after = matmul_rates()
        measured.append((seconds, max(*before.values(), *after.values()), max(before["torch"], after["torch"])))
    return measured


def long_prompt(prompts: list[list[int]], num_tokens: int) -> list[int]:
    """`num_tokens` token ids: the workload's prompts end to end (the content does not change the work)."""
    ids = [token for prompt in prompts for token in prompt]
    while len(ids) < num_tokens:
        ids += ids
    return ids[:num_tokens]


def measure_variant(
    loaded: LoadedModel,
    prompts: list[list[int]],
    args: argparse.Namespace,
    cost: ModelCost,
    peak_flops: float,
    torch_flops: float,
    kv_cache_dtype: torch.dtype,
    enforce_eager: bool,
) -> dict:
    """The workload at every batch size, batch-1 TPOT and the lone prefill, on one model variant.
    The prefill's share of peak is against `peak_flops` (the fastest matmul kernel here) and
    `torch_flops` (torch's own matmul), each as measured at the run's start and around each round."""
    # Warm-up. On a GPU with every prompt, so the big prefill steps' first-use costs (triton's
    # compiles, cuBLAS's choices for their shapes) fall here, not in the first variant's batch.
    is_gpu = next(loaded.model.parameters()).device.type == "cuda"
    run_ours(loaded, prompts if is_gpu else prompts[:2], 4, kv_cache_dtype, enforce_eager)
    batches = {}
    for batch_size in sorted(args.batches, reverse=True):  # the headline batch first, on the coolest machine
        run = run_ours(loaded, prompts[:batch_size], args.output_tokens, kv_cache_dtype, enforce_eager)
        batches[batch_size] = run
    solo = run_ours(loaded, prompts[:1], args.b1_tokens, kv_cache_dtype, enforce_eager)
    prefill_ids = long_prompt(prompts, args.prefill_tokens)
    device = next(loaded.model.parameters()).device.type
    dtype = next(loaded.model.parameters()).dtype
    rounds = prefill_against_peak(
        loaded, prefill_ids, lambda: measure_matmul_flops(dtype, args.matmul_size, 3, device), kv_cache_dtype, enforce_eager
    )
    prefill_s = min(seconds for seconds, _, _ in rounds)
    prefill_flops = cost.prefill_flops(len(prefill_ids))
    return {
        "kv_cache_dtype": str(kv_cache_dtype).removeprefix("torch."),
        "cuda_graphs": is_gpu and not enforce_eager,
        "headline": batches[args.requests],
        "batches": {
            batch_size: {
                "tokens_per_s": run["tokens_per_s"],
                "elapsed_s": run["elapsed_s"],
                "tpot_p50_ms": percentile(run["tpot_ms"], 50),
                "ttft_p50_ms": percentile(run["ttft_ms"], 50),
            }
            for batch_size, run in sorted(batches.items())
        },
        "tpot_b1_ms": solo["tpot_ms"][0],
        "prefill": {
            "num_tokens": len(prefill_ids),
            "ttft_ms": 1e3 * prefill_s,
            "tokens_per_s": len(prefill_ids) / prefill_s,
            "flops_per_s": prefill_flops / prefill_s,
            "of_peak": prefill_flops / prefill_s / peak_flops,
            "of_torch_peak": prefill_flops / prefill_s / torch_flops,
            # each round's rate over the peak (and torch's matmul) measured around it, the median; and the rounds
            "of_peak_paired": statistics.median(prefill_flops / seconds / peak for seconds, peak, _ in rounds),
            "of_torch_peak_paired": statistics.median(prefill_flops / seconds / torch_peak for seconds, _, torch_peak in rounds),
            "rounds": [{"seconds": seconds, "peak_flops": peak, "torch_flops": torch_peak} for seconds, peak, torch_peak in rounds],
        },
    }


def load_variant(quantization: Quantization, dtype: torch.dtype, device: str) -> LoadedModel:
    return load_model(None, dtype, device, select_attention(device), quantization)


@contextlib.contextmanager
def rank_group(quantization: Quantization, dtype: torch.dtype, device: str, size: int, threads: int) -> Iterator[LoadedModel]:
    """Rank 0's model of the embedded SmolLM2 loaded over `size` ranks (ranks 1..N-1 processes of
    their own, `threads` torch threads each, rank 0 too). Every Engine built on it is built on the
    other ranks as well (engine/rank_follower.py), so the workload runs on it unchanged."""
    spec = EngineSpec(open_model(None, quantization=quantization), device, dtype, EngineConfig(), threads, tensor_parallel_size=size)
    peers = PeerRanks.start(spec)
    try:
        loaded = load_rank(peers.spec, 0)
        yield loaded
    except BaseException:
        peers.kill()  # a rank may be inside a collective that will never complete
        raise
    # Engine.close stops the other ranks' engines: one more engine, never stepped, to close
    Engine(loaded, EngineConfig(num_kv_blocks=8)).close()
    loaded.model.tp.close()
    peers.stop()
