"""What the triton kernel tests share: the markers that skip them without triton or a GPU, and a
run of one of this folder's check scripts in triton's CPU interpreter, in a subprocess (@triton.jit
picks interpreted or compiled when a kernel module is imported, so TRITON_INTERPRET=1 must be set
before that and must not leak into the test's process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.kernels import is_triton_available

HERE = Path(__file__).resolve().parent
needs_triton = pytest.mark.skipif(not is_triton_available(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not is_triton_available(), reason="needs a CUDA GPU and triton")


def interpreted_results(script: str) -> list[dict]:
    """The JSON lines `script` (in this folder) prints, run with TRITON_INTERPRET=1 and tests/ on
    the path (reference_model); asserts that it printed some, that none failed and that it exited 0."""
    tests = str(HERE.parent.parent)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, str(HERE / script)], cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert results, f"no results (exit {run.returncode}):\n{run.stderr[-4000:]}"
    failed = [result for result in results if not result["ok"]]
    assert not failed and run.returncode == 0, f"{failed}\n{run.stderr[-4000:]}"
    return results
