"""A worker's engine spec: TANDEM_DEVICE and TANDEM_DTYPE resolved once, at start. "auto" runs on
the GPU when torch sees one and on the CPU otherwise; "cuda" where there is none stops the worker
with one line saying what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.config import Settings, load_settings
from tandem.errors import StartupError
from tandem.models.files import ModelFile
from tandem.models.loader import default_dtype, resolve_device
from tandem.worker.host import EngineSpec

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
