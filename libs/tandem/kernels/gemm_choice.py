"""Which kernel multiplies a packed projection's rows on this CPU, chosen by timing the candidates
on the model's own shapes rather than assumed from the CPU's flags.

The candidates for bf16 rows (models/packed.py):
- `packed`: packed_mm's AVX512-BF16 dot products (kernels/cpu/packed_mm_bf16.cpp), any CPU with
  AVX512-BF16: the fastest at one row, where a step is bound by reading the weights;
- `amx`: packed_mm on AMX tiles, the same packed weights (where the CPU has AMX-BF16 and the
  projection's inputs are a multiple of 32): several times the dot products' rate from 8 rows;
- `onednn`: torch's matmul (oneDNN, itself on AMX where present) with a dense copy of the weight
  (bf16 and float32 weights only), as layers.project calls it.
For float32 rows (AVX2 CPUs) `packed` is packed_mm's AVX2 kernel, against `onednn`.

Each is timed for every projection shape of the model (out x in features, the weight's and the
rows' types) at one row count per bucket of rows (BUCKETS: 1, 2-8, 9-64, over 64); the timings
are cached per CPU, torch version, kernel build and thread count in
`$XDG_CACHE_HOME/tandem/kernels/gemm-<key>.json`, so a worker measures once per machine.

The kernels round differently (a few outputs in a thousand by a bf16 ulp), so which one serves a
row decides its bits. The default policy, `auto`, gives each projection one kernel for every row
count: among the kernels within AUTO_ONE_ROW_SLACK of the fastest at one row (a batch-1 decode
step stays as fast), the one with the least mean slowdown over the buckets. A row then gets the
same bits alone, in a decode batch or among a prefill chunk's rows, and a reply moved to another
worker (or re-prefilled after a restart) continues with the undisturbed text. `fastest`
takes each bucket's fastest kernel (faster where they differ by bucket; a row's bits then depend
on its company); a kernel's name forces it where it serves.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

log = logging.getLogger(__name__)

GemmPolicy = Literal["auto", "fastest", "packed", "amx", "onednn"]
KERNELS = ("packed", "amx", "onednn")
# packed_mm's kernel argument for each of its kernels (kernels/cpu/ops.h); onednn is not packed_mm's
PACKED_KERNEL_CODES = {"packed": 0, "amx": 1}
# On CPU, oneDNN's bf16 matmul rounds a row differently once a call has enough rows (the
# SmolLM2 MLP's 1536-wide down projection from 130 rows on, with 2 threads; some rows change by
# an ulp): a decode row that shares a step with a prefill chunk would come out unlike
# the same row in a decode-only step, so a greedy answer would depend on the company it is
# batched with and a continuation could part from the uninterrupted run. Calls of at most this
# many rows give every row the bits it gets alone (tests/unit/models/test_batch_invariance.py),
# each call writing its rows in place. At the other end, a one-row call can take a kernel of its
# own (a gemv) that rounds unlike every call of two or more rows (seen on an AMD EPYC with
# torch 2.10: the 1536-wide down projection, some of its rows), so a single row is computed as
# two (itself twice) and the first is kept.
CPU_ROWS_PER_MATMUL = 128
# How long a process waits for another's measurement (a few seconds on two cores) before its own.
LOCK_WAIT_S = 120.0
# auto's kernels are those within this factor of the fastest at one row
AUTO_ONE_ROW_SLACK = 1.25
BUCKETS = ("1", "2-8", "9-64", ">64")
BUCKET_ROWS = (1, 8, 64, 256)  # the rows timed for each bucket
# Each timing: ROUNDS rounds of at least ROUND_S and ROUND_CALLS calls, the median round kept.
ROUNDS, ROUND_S, ROUND_CALLS = 3, 0.01, 4
STREAM_BYTES_MAX = 1 << 30


def bucket_of(rows: int) -> int:
    """The index in BUCKETS of a call of `rows` rows."""
    return 0 if rows <= 1 else 1 if rows <= 8 else 2 if rows <= 64 else 3


@dataclass(frozen=True)
class GemmShape:
    """A projection as the kernels see it: (out_features, in_features), the weight's type as stored
    (bf16, float32, int8) and the rows' type."""

    out_features: int
    in_features: int
    weight_dtype: torch.dtype
    x_dtype: torch.dtype

    @property
    def key(self) -> str:
        weight, rows = (str(t).removeprefix("torch.") for t in (self.weight_dtype, self.x_dtype))
        return f"{self.out_features}x{self.in_features} {weight} weights, {rows} rows"


# A kernel's seconds per call at each bucket's rows (BUCKET_ROWS), by kernel name.
Timings = Mapping[str, Sequence[float]]
Timer = Callable[[GemmShape, Sequence[str]], dict[str, list[float]]]


def choose(timings: Timings, policy: GemmPolicy) -> tuple[str, ...]:
    """The kernel serving each bucket under `policy`, from the candidates' timings (a forced kernel
    that was not a candidate here gives `auto`'s choice)."""
    if not timings:
        raise ValueError("no kernel candidates to choose from")
    if policy in timings:
        return (policy,) * len(BUCKETS)
    best = [min(times[b] for times in timings.values()) for b in range(len(BUCKETS))]
    if policy == "fastest":
        return tuple(_fastest_at(timings, b) for b in range(len(BUCKETS)))
    # auto: one kernel for every bucket; ties go to the earlier in KERNELS
    eligible = [name for name, times in timings.items() if times[0] <= AUTO_ONE_ROW_SLACK * best[0]]
    mean_slowdown = {name: statistics.fmean(t / fastest for t, fastest in zip(timings[name], best, strict=True)) for name in eligible}
    ranked = sorted(eligible, key=lambda name: (mean_slowdown[name], KERNELS.index(name) if name in KERNELS else len(KERNELS)))
    return (ranked[0],) * len(BUCKETS)


def _fastest_at(timings: Timings, bucket: int) -> str:
    return min(timings, key=lambda name: timings[name][bucket])


def keeps_row_bits(name: str, shape: GemmShape) -> bool:
    """Whether a kernel gives a row the same bits at every row count: the packed ones always, and
    oneDNN's bf16 matmul in layers.project's calls (tests/unit/models/test_batch_invariance.py);
    its float32 one does not (a row alone and among 600 differ), so `auto` never picks it."""
    return name != "onednn" or shape.x_dtype == torch.bfloat16


def candidates(shape: GemmShape) -> list[str]:
    """The kernels that serve this projection here (the C++ kernels loaded)."""
    names = ["packed"]  # pack_model packs only where packed_mm serves
    if shape.x_dtype == torch.bfloat16 and bool(torch.ops.tandem.packed_mm_amx_supported(shape.in_features, shape.x_dtype)):
        names.append("amx")
    if shape.weight_dtype == shape.x_dtype:  # a dense copy of the weight as it is (no int8 oneDNN path)
        names.append("onednn")
    return names


def measure(shape: GemmShape, names: Sequence[str]) -> dict[str, list[float]]:
    """Seconds per call of each named kernel at BUCKET_ROWS rows. Each call reads its own copy of
    the weights, the copies in turn through a buffer larger than the CPU's last-level cache, so a
    call streams its weights from memory as a model's forward does (timed in cache, a kernel's
    rate at one row said little about a decode step)."""
    packed_shape = (
        (shape.out_features // 16, shape.in_features, 16)
        if shape.x_dtype == torch.float32
        else (shape.out_features // 16, shape.in_features // 2, 32)
    )
    size = shape.out_features * shape.in_features
    itemsize = torch.empty(0, dtype=shape.weight_dtype).element_size()
    copies = max(1, _stream_bytes() // (size * itemsize))
    buffer = torch.full((copies * size,), 1 if shape.weight_dtype == torch.int8 else 0.01, dtype=shape.weight_dtype)
    scale = torch.full((shape.out_features,), 0.01, dtype=shape.x_dtype) if shape.weight_dtype == torch.int8 else None

    def weight(i: int) -> torch.Tensor:
        return buffer[i * size : (i + 1) * size]

    def onednn(x: torch.Tensor, i: int) -> torch.Tensor:  # as models/layers.project calls an nn.Linear
        dense = weight(i).view(shape.out_features, shape.in_features)
        if x.shape[0] == 1:
            return torch.nn.functional.linear(x.expand(2, -1), dense)[:1]
        out = x.new_empty(x.shape[0], shape.out_features)
        for start in range(0, x.shape[0], CPU_ROWS_PER_MATMUL):
            torch.mm(x[start : start + CPU_ROWS_PER_MATMUL], dense.t(), out=out[start : start + CPU_ROWS_PER_MATMUL])
        return out

    calls: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "packed": lambda x, i: torch.ops.tandem.packed_mm(x, weight(i).view(packed_shape), scale, 0),
        "amx": lambda x, i: torch.ops.tandem.packed_mm(x, weight(i).view(packed_shape), scale, 1),
        "onednn": onednn,
    }
    generator = torch.Generator().manual_seed(0)
    timings: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for rows in BUCKET_ROWS:
            x = torch.randn(rows, shape.in_features, generator=generator).to(shape.x_dtype)
            for name in names:
                timings[name].append(_seconds_per_call(calls[name], x, copies))
    return timings


def _stream_bytes() -> int:
    """Bytes of weight copies a timing cycles through: twice the last-level cache (64 MiB where it
    is not known), at most STREAM_BYTES_MAX."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        if text.endswith("K") and text[:-1].isdigit():
            sizes.append(int(text[:-1]) << 10)
        elif text.endswith("M") and text[:-1].isdigit():
            sizes.append(int(text[:-1]) << 20)
    return min(STREAM_BYTES_MAX, 2 * max(sizes, default=32 << 20))


def _seconds_per_call(call: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor, copies: int) -> float:
    """The median over ROUNDS of a round's seconds per call; a round calls on the copies in turn
    (going on from where the last stopped) for at least ROUND_S and ROUND_CALLS calls."""
    call(x, 0)  # warm: oneDNN's primitive, the tiles' configuration
    rounds: list[float] = []
    i = 1
    for _ in range(ROUNDS):
        calls = 0
        start = time.perf_counter()
        while calls < ROUND_CALLS or time.perf_counter() - start < ROUND_S:
            call(x, i % copies)
            i += 1
            calls += 1
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def cache_path(root: Path | None = None) -> Path:
    """Where this machine's timings are kept: one file per CPU, torch, kernel build and thread count."""
    from tandem.kernels import cpu_extension

    base = root or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "kernels"
    parts = (cpu_extension.build_folder().name, torch.__version__, sys.version, str(torch.get_num_threads()))
    return base / f"gemm-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:20]}.json"


class GemmChooser:
    """Chooses a kernel per bucket for each projection shape, timing a shape once (timer) and
    keeping the timings in `path` (None: in memory only)."""

    def __init__(self, policy: GemmPolicy = "auto", timer: Timer = measure, path: Path | None = None) -> None:
        self.policy = policy
        self._timer = timer
        self._path = path
        self._timings: dict[str, dict[str, list[float]]] = self._read()
        self.chosen: dict[str, tuple[str, ...]] = {}  # shape key -> kernel per bucket, as chosen here

    def timings(self, shape: GemmShape, names: Sequence[str]) -> dict[str, list[float]]:
        """Every named kernel's timings for the shape: cached, else measured now and saved."""
        if self._missing(shape, names):
            with self._lock():  # one process measures; the others read what it wrote
                self._timings = {**self._timings, **self._read()}
                missing = self._missing(shape, names)
                if missing:
                    measured = self._timer(shape, missing)
                    known = self._timings.get(shape.key, {})
                    self._timings[shape.key] = {**known, **{name: [float(t) for t in measured[name]] for name in missing}}
                    self._write()
        known = self._timings[shape.key]
        return {name: known[name] for name in names}

    def _missing(self, shape: GemmShape, names: Sequence[str]) -> list[str]:
        known = self._timings.get(shape.key, {})
        return [name for name in names if len(known.get(name, ())) != len(BUCKETS)]

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """The timings file to one process at a time (an flock, released if its holder dies), so
        workers starting together measure once and choose alike."""
        if self._path is None:
            yield
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            handle = self._path.with_name(self._path.name + ".lock").open("w")
        except OSError:  # a read-only home: measured in this process alone
            yield
            return
        with handle:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:  # its holder stopped: measure here, unshared
                        log.warning("kernel timings: %s held for over %.0f s; measuring without it", handle.name, LOCK_WAIT_S)
                        yield
                        return
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def kernels(self, shape: GemmShape, names: Sequence[str]) -> tuple[str, ...]:
        """The kernel per bucket for a projection of this shape among `names` (the ones that serve it)."""
        if self.policy == "auto":
            names = [name for name in names if keeps_row_bits(name, shape)]
        if self.policy in names:  # forced: nothing to time
            chosen: tuple[str, ...] = (self.policy,) * len(BUCKETS)
        elif len(names) == 1:
            chosen = (names[0],) * len(BUCKETS)
        else:
            chosen = choose(self.timings(shape, names), self.policy)
        self.chosen[shape.key] = chosen
        return chosen

    def _read(self) -> dict[str, dict[str, list[float]]]:
        if self._path is None or not self._path.is_file():
            return {}
        try:
            data = json.loads(self._path.read_text())
        except (OSError, ValueError) as error:  # a file cut short or written by another version: measure again
            log.warning("ignoring the kernel timings in %s: %s", self._path, error)
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self) -> None:
        if self._path is None:
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            spare = self._path.with_name(f"{self._path.name}.{os.getpid()}.tmp")
            spare.write_text(json.dumps(self._timings, indent=1, sort_keys=True))
            spare.replace(self._path)  # whole or not at all, for processes reading it at once
        except OSError as error:  # a read-only home: the timings serve this process only
            log.warning("could not keep the kernel timings in %s: %s", self._path, error)


def describe(chooser: GemmChooser) -> list[str]:
    """One line per shape: the kernel per bucket, as the bench and the worker's log print them."""
    return [
        f"{key}: " + ", ".join(f"{bucket} {name}" for bucket, name in zip(BUCKETS, chosen, strict=True))
        for key, chosen in sorted(chooser.chosen.items())
    ]
