#!/usr/bin/env bash
# The GPU path's checks and numbers, on a machine with an NVIDIA GPU and the embedded model
# installed: the triton kernels' and engine tests that skip without CUDA, then bench/engine.py on
# the GPU with decode steps as CUDA graphs and eagerly, bf16 and int8 (fp8 weights: torch._scaled_mm in
# test_fp8_cuda.py), and bench/attention.py's
# kernels on the engine's attention shapes, and bench/gpu_step.py's split of a decode step.
#
#     bench/gpu_check.sh [OUT_DIR]   # OUT_DIR (default .): pytest.log, attention.json, engine-cuda.json/.log, gpu-step.log
#
# PYTHON (default .venv/bin/python, else python3) runs it, with PYTEST_ARGS added to pytest's
# (--noconftest where the session servers' packages are not installed); every part runs whatever
# another gave, and the exit code is 1 when any failed.
set -u
cd "$(dirname "$0")/.."
out=${1:-.}
mkdir -p "$out"
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
"$python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
"$python" -m pytest -q -p no:cacheprovider --durations=10 \
    ${PYTEST_ARGS:-} tests/unit/kernels/test_paged_attention_triton.py tests/unit/kernels/test_fused_triton.py tests/unit/kernels/test_int8_triton.py tests/unit/models/test_fp8_cuda.py \
    tests/unit/engine/test_engine_cuda.py \
    2>&1 | tee "$out/pytest.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$python" bench/attention.py --rounds 10 --json "$out/attention.json" || status=1
"$python" bench/engine.py --device cuda --skip-hf --cuda-graphs both --out "$out/engine-cuda.json" 2>&1 | tee "$out/engine-cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$python" bench/gpu_step.py 2>&1 | tee "$out/gpu-step.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
