"""Tensor parallelism end to end on the CPU: rank 0 in this process, the other ranks in processes of
their own (worker/engine_ranks.py), gloo between them. In float32 a TP engine's greedy answers are
token for token those of one rank, on Llama- and Qwen2-style checkpoints written here (Qwen2's qkv
biases split with their rows; fewer KV heads than ranks: KV heads replicated; a vocabulary that
does not divide: the last rank's rows padded)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from helpers import is_running, wait_until
from hf_models import write_hf_checkpoint
from reference_model import random_model, save_safetensors_folder, tiny_config, write_tokenizer

from tandem.engine.engine import Engine, EngineConfig, Request
from tandem.engine.sequence import SamplingOptions
from tandem.errors import StartupError
from tandem.kernels import select_attention
from tandem.models import tensor_parallel
from tandem.models.files import open_model
from tandem.models.tensor_parallel import Shard
from tandem.worker.engine_ranks import PeerRanks
from tandem.worker.engine_spec import EngineSpec, build_engine

PROMPTS = [[5, 17, 200, 31, 8, 99, 143, 250, 7], [400, 3, 3, 12], list(range(40, 90))]  # the last: several blocks
MAX_TOKENS = 20


def _checkpoint(folder: Path, seed: int, **config: object) -> Path:
    model = random_model(tiny_config(**config), seed, select_attention("cpu"))
    save_safetensors_folder(model, folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 8 heads, 2 KV heads (replicated over 4 ranks), vocabulary 510 (not a multiple of 4), untied head
    return _checkpoint(
        tmp_path_factory.mktemp("llama"),
        1,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,  # the CPU attention kernel gives a row different bits in company at head_dim 16 (a known gap)
        vocab_size=510,
        intermediate_size=192,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("qwen2"), 2, num_heads=4, num_kv_heads=4, attention_bias=True)


def _spec(path: Path | None, size: int) -> EngineSpec:
    config = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=32)  # prompts in chunks: several steps of mixed work
    return EngineSpec(open_model(path), "cpu", torch.float32, config, torch_threads=1, tensor_parallel_size=size)


@dataclasses.dataclass
class Group:
    engine: Engine
    peers: PeerRanks | None


def _start(path: Path, size: int) -> Iterator[Group]:
    spec = _spec(path, size)
    peers = PeerRanks.start(spec) if size > 1 else None
    engine = build_engine(peers.spec if peers else spec)
    try:
        yield Group(engine, peers)
    finally:
        engine.close()
        engine.loaded.model.tp.close()
        if peers is not None:
            peers.stop()


def _answers(engine: Engine) -> list[list[int]]:
    requests = [
        Request(f"r{i}", tuple(prompt), SamplingOptions(max_tokens=MAX_TOKENS, ignore_eos=True)) for i, prompt in enumerate(PROMPTS)
    ]
    streams = engine.generate(requests)
    return [[token for output in streams[r.request_id] for token in output.new_token_ids] for r in requests]


def _greedy(path: Path, size: int) -> list[list[int]]:
    for group in _start(path, size):
        return _answers(group.engine)
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def llama_one_rank(llama: Path) -> list[list[int]]:
    answers = _greedy(llama, 1)
    assert all(len(answer) == MAX_TOKENS for answer in answers)
    return answers


def test_a_llama_engine_over_two_ranks_answers_what_one_rank_does(llama: Path, llama_one_rank: list[list[int]]):
    assert _greedy(llama, 2) == llama_one_rank


def test_over_four_ranks_each_holds_its_share_and_the_answers_are_one_ranks(llama: Path, llama_one_rank: list[list[int]]):
    """Two KV heads over four ranks: each KV head on two ranks; 510 tokens: 128 rows a rank, the last padded."""
    for group in _start(llama, 4):
        engine = group.engine
        local = engine.loaded.model.config
        assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 48)
        assert engine.facts().kv_shape.num_kv_heads == 1 and engine.facts().tensor_parallel_size == 4
        assert engine.loaded.model.model.embed_tokens.weight.shape[0] == Shard(0, 4).vocab_rows(engine.loaded.config) == 128
        assert _answers(engine) == llama_one_rank


def test_in_bf16_an_answer_over_four_ranks_is_the_same_alone_or_batched(llama: Path):
    """The all-reduce sums in rank order whatever the batch (tensor_parallel.py): a row's bits are its
    own, so a continuation on another worker finds the uninterrupted answer."""
    spec = dataclasses.replace(_spec(llama, 4), dtype=torch.bfloat16)
    peers = PeerRanks.start(spec) if spec.tensor_parallel_size > 1 else None
    engine = build_engine(peers.spec if peers else spec)
    try:
        together = _answers(engine)
        alone = []
        for i, prompt in enumerate(PROMPTS):
            stream = engine.generate([Request(f"a{i}", tuple(prompt), SamplingOptions(max_tokens=MAX_TOKENS, ignore_eos=True))])[f"a{i}"]
            alone.append([token for output in stream for token in output.new_token_ids])
    finally:
        engine.close()
        engine.loaded.model.tp.close()
        if peers:
            peers.stop()
    assert alone == together


def test_a_qwen2_engine_over_two_ranks_answers_what_one_rank_does(qwen2: Path):
    assert _greedy(qwen2, 2) == _greedy(qwen2, 1)


@pytest.mark.parametrize("architecture", ["qwen3", "gemma2", "phi3"])
def test_other_architectures_over_two_ranks_answer_what_one_rank_does(architecture: str, tmp_path: Path):
    """Qwen3's per-head norms whole on every rank, Gemma 2's sandwich norms after the all-reduces
    and its soft-capped logits after the gather, Phi-3's fused tensors split into each rank's rows
    (and its one KV head replicated)."""
    write_hf_checkpoint(architecture, tmp_path, seed=4)
    assert _greedy(tmp_path, 2) == _greedy(tmp_path, 1)


def test_a_size_that_does_not_split_the_heads_is_refused_naming_the_setting(llama: Path):
    with pytest.raises(StartupError, match="TANDEM_TENSOR_PARALLEL_SIZE=3"):
        Shard(0, 3).local_config(tiny_config(num_heads=8, num_kv_heads=2, intermediate_size=192))


def test_a_rank_killed_ends_its_group_and_is_reported(llama: Path):
    """Any rank's death is the group's: the watcher reports it, and rank 0's next step fails instead of waiting."""
    deaths: list[tuple[int, int]] = []
    for group in _start(llama, 2):
        assert group.peers is not None
        group.peers.watch(lambda rank, code: deaths.append((rank, code)))
        (pid,) = group.peers.pids
        os.kill(pid, signal.SIGKILL)

        async def reported() -> bool:
            return bool(deaths)

        asyncio.run(wait_until(reported, timeout_s=10))
        assert deaths == [(1, -signal.SIGKILL)]
        assert not is_running(pid)
        group.engine.add(Request("after", (5, 6, 7), SamplingOptions(max_tokens=2)))
        with pytest.raises(RuntimeError):  # gloo's error: the peer's connection is closed
            group.engine.step()
        group.engine.close = lambda: None  # type: ignore[method-assign]  # nothing to stop: the group is gone


def test_a_group_stopped_by_rank_0_ends_cleanly_and_reports_no_death(llama: Path):
    spec = _spec(llama, 2)
    peers = PeerRanks.start(spec)
    engine = build_engine(peers.spec)
    deaths: list[tuple[int, int]] = []
    peers.watch(lambda rank, code: deaths.append((rank, code)))
    (pid,) = peers.pids
    peers.ending()
    engine.close()  # rank 0 tells the others to end
    engine.loaded.model.tp.close()

    async def ended() -> bool:
        return not is_running(pid)

    asyncio.run(wait_until(ended, timeout_s=10))
    peers.stop()
    assert deaths == []


def test_a_rank_that_never_joins_fails_the_meeting_instead_of_a_wait_for_ever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(tensor_parallel, "JOIN_TIMEOUT", timedelta(seconds=2))
    with pytest.raises(RuntimeError):  # the file store gives up waiting for rank 1
        tensor_parallel.join(0, 2, f"file://{tmp_path / 'rendezvous'}", "cpu")


def test_a_rank_whose_parent_is_already_gone_ends_at_once():
    """The parent-death signal cannot cover a parent that died before the rank set it: the rank
    then finds itself another's child (init's) and ends before it loads anything."""
    not_its_parent = os.getpid() + 1_000_000  # no process has it; the rank's parent is this one
    rank = subprocess.Popen([sys.executable, "-m", "tandem.worker.engine_rank", "1", str(not_its_parent)], stdin=subprocess.PIPE)
    try:
        assert rank.wait(timeout=60) == 1  # its spec never came: it did not wait for one
    finally:
        rank.kill()
        assert rank.stdin is not None
        rank.stdin.close()
        rank.wait()
