"""What `tandem up`'s workers compute on. A worker of N tensor-parallel ranks is N processes: on a
host with GPUs it gets N GPUs of its own (its CUDA_VISIBLE_DEVICES; rank r takes the r-th), the
workers in start order taking consecutive ones (prefill 0..N-1, decode N..2N-1, ...); on a CPU
every rank of every worker gets an equal share of the cores as torch threads."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from tandem.errors import StartupError


class NotEnoughGpus(StartupError):
    """The workers' ranks need more GPUs than the host has."""


def torch_threads_per_rank(num_ranks: int, num_cores: int | None = None) -> int:
    """The torch threads each of `num_ranks` processes computing on one machine's cores gets (a
    worker's ranks each count): an equal share of all cores but one, at least one thread. Each
    taking torch's default (one per core) oversubscribes the cores: with two decode workers and a
    prefill worker on two cores, bench/drills.py's streamed replies took several times longer that
    way than at one thread each. The core left over is the stack's services' (chat, relay, router,
    NATS, Redis), as vLLM's CPU backend keeps one for its serving frontend: a lone decode worker on
    two cores computing on both stalled in every step the services took one of them
    (bench/overload.py's paid TTFT p95 was far worse at two threads than at one)."""
    cores = num_cores if num_cores is not None else len(os.sched_getaffinity(0))
    return max(1, (cores - 1) // max(1, num_ranks))


def assign_gpus(ranks: Mapping[str, int], gpus: Sequence[str]) -> dict[str, str]:
    """Each worker's CUDA_VISIBLE_DEVICES: `ranks` maps worker names, in start order, to their
    rank counts; `gpus` are the host's GPU ids, in order. The workers take consecutive runs of
    them. NotEnoughGpus, naming what each worker needs, when they need more than there are."""
    needed = sum(ranks.values())
    if needed > len(gpus):
        wants = ", ".join(f"{name} {count}" for name, count in ranks.items())
        raise NotEnoughGpus(
            f"the workers need {needed} GPUs, one per rank ({wants}), and this host has {len(gpus)}: lower "
            "--tensor-parallel-size, --prefill-workers, --decode-workers or --small-decode-workers, or set --device cpu"
        )
    visible, first = {}, 0
    for name, count in ranks.items():
        visible[name] = ",".join(gpus[first : first + count])
        first += count
    return visible


def host_gpus(device: str) -> tuple[str, ...]:
    """The GPUs this host's workers may take, as CUDA_VISIBLE_DEVICES ids: those torch sees (the
    ones this process's own CUDA_VISIBLE_DEVICES names, when it is set), none when `device` is
    "cpu" or torch sees no GPU."""
    if device == "cpu":
        return ()
    import torch  # only here: the stack's own process needs it for nothing else

    count = torch.cuda.device_count()
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [item.strip() for item in inherited.split(",")] if inherited is not None else [str(index) for index in range(count)]
    return tuple(ids[:count])
