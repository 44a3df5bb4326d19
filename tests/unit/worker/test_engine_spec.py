"""A worker's engine spec: TANDEM_DEVICE and TANDEM_DTYPE resolved once, at start. "auto" runs on
the GPU when torch sees one and on the CPU otherwise; "cuda" where there is none stops the worker
with one line saying what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.config import Settings, load_settings
from tandem.engine.repetition import RepetitionStop
from tandem.errors import StartupError
from tandem.models.files import ModelFile
from tandem.models.loader import default_dtype, resolve_device
from tandem.worker.engine_spec import EngineSpec

MODEL = ModelFile(Path("model.gguf"), "model", "gguf")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_auto_on_this_cpu_only_machine_is_the_cpu_in_its_native_dtype():
    spec = EngineSpec.from_settings(Settings(device="auto", dtype="auto"), MODEL)
    assert (spec.device, spec.dtype) == ("cpu", default_dtype("cpu"))


def test_auto_is_the_gpu_when_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"


def test_auto_is_the_cpu_when_torch_sees_no_gpu(no_gpu):
    assert resolve_device("auto") == "cpu"


def test_cuda_without_a_gpu_stops_the_worker_at_start_in_one_line(no_gpu):
    with pytest.raises(StartupError) as failure:
        EngineSpec.from_settings(Settings(device="cuda"), MODEL)
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith("TANDEM_DEVICE=cuda, but torch ")
    assert message.endswith("sees no CUDA GPU here: use cpu or auto")


def test_an_explicit_dtype_is_kept_on_the_cpu(no_gpu):
    spec = EngineSpec.from_settings(Settings(device="cpu", dtype="fp32"), MODEL)
    assert (spec.device, spec.dtype) == ("cpu", torch.float32)


def test_a_device_other_than_auto_cpu_or_cuda_is_a_bad_setting():
    with pytest.raises(StartupError, match="^TANDEM_DEVICE: Input should be 'auto', 'cpu' or 'cuda'$"):
        load_settings(device="tpu")


def test_the_kv_cache_holds_the_engine_s_dtype_unless_told_bf16_under_fp32_on_the_cpu(no_gpu):
    assert EngineSpec.from_settings(Settings(device="cpu", dtype="fp32"), MODEL).engine.kv_cache_dtype is None  # the model's
    spec = EngineSpec.from_settings(Settings(device="cpu", dtype="fp32", kv_cache_dtype="bf16"), MODEL)
    assert (spec.dtype, spec.engine.kv_cache_dtype) == (torch.float32, torch.bfloat16)
    assert (
        EngineSpec.from_settings(Settings(device="cpu", dtype="bf16", kv_cache_dtype="bf16"), MODEL).engine.kv_cache_dtype == torch.bfloat16
    )


@pytest.mark.parametrize(("device", "dtype", "kv_cache_dtype"), [("cpu", "bf16", "fp32"), ("cuda", "fp32", "bf16")])
def test_a_kv_cache_dtype_no_kernel_serves_stops_the_worker_at_start_in_one_line(monkeypatch, device, dtype, kv_cache_dtype):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    with pytest.raises(StartupError, match=f"^TANDEM_KV_CACHE_DTYPE={kv_cache_dtype} under a .* engine on {device}: .*; use auto$"):
        EngineSpec.from_settings(Settings(device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype), MODEL)


def test_a_prefill_worker_s_engine_captures_no_cuda_graphs_and_a_decode_worker_s_does(no_gpu):
    assert EngineSpec.from_settings(Settings(), MODEL, "prefill").engine.enforce_eager
    assert not EngineSpec.from_settings(Settings(), MODEL, "decode").engine.enforce_eager


def test_enforce_eager_turns_a_decode_worker_s_cuda_graphs_off(no_gpu):
    assert EngineSpec.from_settings(Settings(enforce_eager=True), MODEL, "decode").engine.enforce_eager


def test_the_cpu_gemm_policy_reaches_the_spec_and_a_policy_no_kernel_has_is_a_bad_setting(monkeypatch, no_gpu):
    assert EngineSpec.from_settings(Settings(device="cpu"), MODEL).cpu_gemm == "auto"
    monkeypatch.setenv("TANDEM_CPU_GEMM", "amx")
    assert EngineSpec.from_settings(load_settings(device="cpu"), MODEL).cpu_gemm == "amx"
    monkeypatch.setenv("TANDEM_CPU_GEMM", "avx9000")
    with pytest.raises(StartupError, match="TANDEM_CPU_GEMM: Input should be 'auto'"):
        load_settings(device="cpu")


def test_the_repetition_stop_is_on_by_default_from_the_settings_and_zero_turns_it_off(no_gpu):
    stop = EngineSpec.from_settings(Settings(device="cpu"), MODEL).engine.repetition_stop
    assert stop is not None and (stop.max_ngram_tokens, stop.min_repeats, stop.min_span_tokens) == (64, 3, 64)
    tuned = Settings(device="cpu", repetition_stop_max_ngram_tokens=16, repetition_stop_repeats=5, repetition_stop_min_tokens=0)
    assert EngineSpec.from_settings(tuned, MODEL).engine.repetition_stop == RepetitionStop(16, 5, 0)
    assert EngineSpec.from_settings(Settings(device="cpu", repetition_stop_max_ngram_tokens=0), MODEL).engine.repetition_stop is None
