"""A worker's engine batch limits and KV cache size come from its settings (TANDEM_MAX_NUM_SEQS,
TANDEM_MAX_NUM_BATCHED_TOKENS, TANDEM_MAX_NUM_PREFILL_ONLY_BATCHED_TOKENS,
TANDEM_MAX_NUM_UNPAID_BATCHED_TOKENS, TANDEM_KV_CACHE_MIB), not from constants."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.config import Settings, load_settings
from tandem.engine.engine import EngineConfig
from tandem.engine.repetition import RepetitionStop
from tandem.errors import StartupError
from tandem.models.files import ModelFile
from tandem.worker.engine_spec import EngineSpec

MODEL = ModelFile(Path("model.gguf"), "model", "gguf")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path: Path):
    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TANDEM_CONFIG", str(tmp_path / "absent.toml"))


DEFAULT_REPETITION_STOP = RepetitionStop(max_ngram_tokens=64, min_repeats=3, min_span_tokens=64)


def test_the_engine_gets_the_batch_limits_and_kv_cache_from_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("TANDEM_MAX_NUM_BATCHED_TOKENS", "96")
    monkeypatch.setenv("TANDEM_KV_CACHE_MIB", "64")
    monkeypatch.setenv("TANDEM_MAX_NUM_UNPAID_BATCHED_TOKENS", "32")
    monkeypatch.setenv("TANDEM_MAX_NUM_PREFILL_ONLY_BATCHED_TOKENS", "384")
    spec = EngineSpec.from_settings(load_settings(device="cpu"), MODEL)
    assert spec.engine == EngineConfig(
        kv_cache_mib=64,
        max_num_seqs=8,
        max_num_batched_tokens=96,
        max_num_prefill_only_tokens=384,
        max_num_unpaid_tokens=32,
        repetition_stop=DEFAULT_REPETITION_STOP,
    )


def test_unset_limits_are_the_engines_own_defaults():
    """...and a worker's engine has the repetition stop, which a bare EngineConfig (a bench's) has not."""
    spec = EngineSpec.from_settings(Settings(device="cpu"), MODEL)
    assert spec.engine == EngineConfig(repetition_stop=DEFAULT_REPETITION_STOP)
    assert EngineSpec.from_settings(Settings(device="cpu", repetition_stop_max_ngram_tokens=0), MODEL).engine == EngineConfig()
    assert spec.torch_threads == 0  # torch's own count


def test_the_engine_gets_its_torch_threads_from_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_TORCH_THREADS", "1")
    assert EngineSpec.from_settings(load_settings(device="cpu"), MODEL).torch_threads == 1
    monkeypatch.setenv("TANDEM_TORCH_THREADS", "-1")
    with pytest.raises(StartupError, match="^TANDEM_TORCH_THREADS: Input should be greater than or equal to 0$"):
        load_settings()


@pytest.mark.parametrize(
    "name",
    [
        "TANDEM_MAX_NUM_SEQS",
        "TANDEM_MAX_NUM_BATCHED_TOKENS",
        "TANDEM_MAX_NUM_PREFILL_ONLY_BATCHED_TOKENS",
        "TANDEM_MAX_NUM_UNPAID_BATCHED_TOKENS",
        "TANDEM_KV_CACHE_MIB",
    ],
)
def test_a_limit_below_one_stops_the_process_naming_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "0")
    with pytest.raises(StartupError, match=f"^{name}: Input should be greater than or equal to 1$"):
        load_settings()


def test_an_engine_pinned_to_cpus_takes_one_torch_thread_per_cpu_unless_told(monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_AFFINITY", "0,2-3")
    assert EngineSpec.from_settings(load_settings(device="cpu"), MODEL).torch_threads == 3
    monkeypatch.setenv("TANDEM_TORCH_THREADS", "1")
    assert EngineSpec.from_settings(load_settings(device="cpu"), MODEL).torch_threads == 1


def test_a_step_of_prompts_alone_takes_2048_tokens_on_a_cpu_unless_a_budget_is_set():
    """The default step budget's CPU engine lets prompts alone take 2048 tokens a step (vLLM-CPU's
    server budget); a configured step budget binds them too, unless theirs is configured as well,
    and theirs is never below the step budget."""
    assert EngineConfig().prefill_only_tokens_on("cpu") == 2048
    assert EngineConfig().prefill_only_tokens_on("cuda") == 8192
    assert EngineConfig(max_num_batched_tokens=96).prefill_only_tokens_on("cpu") == 96
    assert EngineConfig(max_num_batched_tokens=96, max_num_prefill_only_tokens=384).prefill_only_tokens_on("cpu") == 384
    assert EngineConfig(max_num_prefill_only_tokens=64).prefill_only_tokens_on("cpu") == 512
