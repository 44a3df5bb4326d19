"""The KV cache's size and the max_model_len served (engine/memory_budget.py): a size given in MiB
is what it was; a share of the machine's memory is that share less the weights and a profiled
activation peak; a max_model_len that cannot be served stops the start with a StartupError, and an
unset one is capped to a cache given in MiB, with a warning."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from reference_model import random_model, tiny_config
from test_engine import byte_level_tokenizer

from tandem.config import load_settings
from tandem.engine.engine import Engine, EngineConfig
from tandem.engine.memory_budget import BudgetSource, KvPlan, cpu_peak_bytes, device_memory_bytes, kv_bytes_per_block, plan_kv_cache
from tandem.errors import StartupError
from tandem.kernels import is_triton_available, paged_attention_triton
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.files import ModelFile
from tandem.models.llama import LlamaForCausalLM
from tandem.models.loader import LoadedModel
from tandem.worker.engine_spec import EngineSpec

WINDOW = 4096  # the model's context window: more than 1 MiB of its KV cache holds
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    config = tiny_config(vocab_size=512, max_position_embeddings=WINDOW)
    model = random_model(config, seed=0, attention=paged_attention_reference)
    return LoadedModel(model=model.eval(), config=config, tokenizer=byte_level_tokenizer(config.vocab_size))


def plan(model: LlamaForCausalLM, **config: Any) -> KvPlan:
    return plan_kv_cache(model, EngineConfig(**config), torch.float32, CPU)


def test_an_explicit_kv_cache_mib_gives_the_blocks_it_always_did(tiny):
    c = tiny.config
    bytes_per_block = c.num_layers * 2 * 16 * c.num_kv_heads * c.head_dim * 4  # the engine's formula before the plan
    kv = plan(tiny.model, kv_cache_mib=3, max_model_len=1024)
    assert kv.num_blocks == 3 * 2**20 // bytes_per_block == 384
    assert (kv.bytes_per_block, kv.max_model_len, kv.budget.source) == (bytes_per_block, 1024, BudgetSource.KV_CACHE_MIB)
    assert kv.budget.activation_bytes == 0, "a size given outright profiles nothing"


def test_a_share_of_ram_is_that_share_less_the_weights_and_the_profiled_activations(tiny):
    # max_model_len below max_num_batched_tokens: the profiled step is three prefills (256, 256, 88 tokens).
    config = dict(max_model_len=256, max_num_batched_tokens=600)
    small, large = plan(tiny.model, gpu_memory_utilization=0.01, **config), plan(tiny.model, gpu_memory_utilization=0.02, **config)
    weights = sum(p.numel() * p.element_size() for p in tiny.model.parameters())
    weights += sum(b.numel() * b.element_size() for b in tiny.model.buffers())
    for kv, utilization in ((small, 0.01), (large, 0.02)):
        budget = kv.budget
        assert budget.source is BudgetSource.UTILIZATION and budget.utilization == utilization
        assert budget.total_bytes == device_memory_bytes(CPU) > 0
        assert budget.weights_bytes == weights
        assert budget.activation_bytes >= 0
        assert budget.kv_bytes == int(utilization * budget.total_bytes) - budget.weights_bytes - budget.activation_bytes
        assert kv.num_blocks == budget.kv_bytes // kv_bytes_per_block(tiny.config, 16, torch.float32)
        assert kv.max_model_len == 256
    assert large.num_blocks > small.num_blocks


def test_the_cpu_peak_counts_memory_a_step_frees_before_it_ends():
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("this host refuses to reset the peak resident memory (the plan falls back to VmRSS)")

    def step() -> None:
        block = torch.ones(64 * 2**20, dtype=torch.uint8)  # touched: resident
        del block

    assert cpu_peak_bytes(step) > 48 * 2**20  # most of it: pages the process held already may serve some


def test_a_max_model_len_the_cache_cannot_hold_stops_the_start(tiny):
    # 1 MiB: 128 blocks, of which 124 above the reserve hold 1984 tokens of one sequence.
    assert plan(tiny.model, kv_cache_mib=1, max_model_len=1984).max_model_len == 1984
    with pytest.raises(StartupError, match="TANDEM_MAX_MODEL_LEN"):
        plan(tiny.model, kv_cache_mib=1, max_model_len=1985)


def test_a_share_of_memory_too_small_for_the_models_window_stops_the_start(tiny):
    with pytest.raises(StartupError, match="TANDEM_GPU_MEMORY_UTILIZATION"):
        plan(tiny.model, gpu_memory_utilization=1e-9)  # less than the weights: no blocks at all


def test_a_max_model_len_past_the_models_window_stops_the_start(tiny):
    with pytest.raises(StartupError, match="TANDEM_MAX_MODEL_LEN"):
        plan(tiny.model, kv_cache_mib=64, max_model_len=WINDOW + 1)


def test_an_unset_max_model_len_is_capped_to_a_small_cache_with_a_warning(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.engine.memory_budget"):
        engine = Engine(tiny, EngineConfig(kv_cache_mib=1))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1984" in warnings[0].getMessage()
    assert engine.kv_plan.max_model_len == engine.scheduler.config.max_model_len == engine.facts().max_position_embeddings == 1984
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [
        "KV cache: 128 blocks of 16 tokens = 2048 tokens, 1.03 sequences of max_model_len 1984 (budget from TANDEM_KV_CACHE_MIB: 1.0 MiB)"
    ]


def test_a_workers_settings_reach_the_engines_sizing(monkeypatch, tmp_path):
    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TANDEM_CONFIG", str(tmp_path / "absent.toml"))
    monkeypatch.setenv("TANDEM_GPU_MEMORY_UTILIZATION", "0.5")
    monkeypatch.setenv("TANDEM_MAX_MODEL_LEN", "2048")
    engine = EngineSpec.from_settings(load_settings(device="cpu"), ModelFile(Path("model.gguf"), "model", "gguf")).engine
    assert (engine.kv_cache_mib, engine.gpu_memory_utilization, engine.max_model_len) == (None, 0.5, 2048)


@pytest.mark.skipif(not torch.cuda.is_available() or not is_triton_available(), reason="needs a CUDA GPU and triton")
def test_on_a_gpu_nine_tenths_of_its_memory_less_weights_and_activations_is_the_kv_cache():
    cuda = torch.device("cuda")
    model = random_model(tiny_config(max_position_embeddings=WINDOW), seed=0, attention=paged_attention_triton).to(cuda).eval()
    small = plan_kv_cache(model, EngineConfig(max_num_batched_tokens=256), torch.float32, cuda)
    large = plan_kv_cache(model, EngineConfig(max_num_batched_tokens=4096), torch.float32, cuda)
    for kv in (small, large):
        budget = kv.budget
        assert budget.source is BudgetSource.UTILIZATION and budget.utilization == 0.9
        assert budget.total_bytes == torch.cuda.mem_get_info(cuda)[1]
        assert budget.weights_bytes == sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        assert budget.kv_bytes == int(0.9 * budget.total_bytes) - budget.weights_bytes - budget.activation_bytes
        assert kv.num_blocks == budget.kv_bytes // kv.bytes_per_block and kv.max_model_len == WINDOW
    assert large.budget.activation_bytes > small.budget.activation_bytes > 0, "a larger step's peak is larger"


def test_blocks_given_outright_cap_the_length_without_a_warning(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.engine.memory_budget"):
        kv = plan(tiny.model, num_kv_blocks=8)
    assert (kv.num_blocks, kv.max_model_len) == (8, 64)  # 4 blocks above the reserve
    assert [r.levelno for r in caplog.records] == [logging.INFO], "only the start-up line"
