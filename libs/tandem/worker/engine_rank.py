"""One of ranks 1..N-1 of a tensor-parallel engine: `python -m tandem.worker.engine_rank RANK
PARENT_PID`, started by engine_ranks.PeerRanks only, which writes (spec, rank, KV memfd or None)
pickled to its stdin.

It joins the group, loads its shard of the model, builds its engine (the same sizing as rank 0's,
with the same collectives) and follows rank 0's steps until rank 0 stops it or the group breaks.
It dies with its parent (the process that started the group), whichever way that one dies: the
parent-death signal is set first, before torch and the model code are imported (seconds), and a
parent that died before that (this process then belongs to init) ends it at once. Like the engine
process, it imports nothing NATS-facing."""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """The kernel kills this process when its parent ends (Linux); a parent already gone ends it now."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: rank 0's broken collectives end it instead
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def main() -> None:
    _die_with_parent(int(sys.argv[2]))
    from tandem.worker.engine_spec import follow_engine  # torch: after the parent-death signal is set
    from tandem.worker.shared_kv import shared_kv_cache

    # The worker drains on SIGTERM and SIGINT (they may reach its whole process group): rank 0 tells
    # this rank when to end.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec, rank, kv_fd = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=spec.log_level.upper(), format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    follow_engine(spec, rank, None if kv_fd is None else shared_kv_cache(kv_fd))


if __name__ == "__main__":
    main()
