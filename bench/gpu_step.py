"""A steady decode step on a GPU, timed apart: the whole engine step against its CUDA graph's
replay alone (the rest is the host's: scheduling, staging, sampling, the tokens' copy back).

    python bench/gpu_step.py [--batches 1,8,64] [--steps 100]

SmolLM2 in bf16; each batch size's sequences hold 200-token prompts and decode past them.
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.kernels import select_attention
from tandem.models.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    loaded = load_model(None, torch.bfloat16, "cuda", select_attention("cuda"))
    for n in (int(b) for b in args.batches.split(",")):
        engine = Engine(loaded, EngineConfig(num_kv_blocks=(n * (200 + 20 + args.steps)) // 16 + 64, max_num_seqs=n))
        for i in range(n):
            engine.add(Request(f"r{i}", tuple(range(100 + i, 300 + i)), SamplingOptions(max_tokens=20 + args.steps, ignore_eos=True)))
        while engine.stats().num_steps < 5:  # the prefill, then decodes
            engine.step()
        torch.cuda.synchronize()
        start_s = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step_ms = 1e3 * (time.perf_counter() - start_s) / args.steps
        graph = engine.runner.graphs.graph_for(n) if engine.runner.graphs else None
        if graph is None:
            raise SystemExit("no CUDA graph served this batch")
        torch.cuda.synchronize()
        start_s = time.perf_counter()
        for _ in range(args.steps):
            graph.replay()  # the last step's inputs again: the same K and V into the same slots
        torch.cuda.synchronize()
        replay_ms = 1e3 * (time.perf_counter() - start_s) / args.steps
        print(f"batch {n}: engine step {step_ms:.3f} ms, graph replay alone {replay_ms:.3f} ms, host {step_ms - replay_ms:.3f} ms")


if __name__ == "__main__":
    main()
