"""`tandem up --tensor-parallel-size N --gpu-memory-utilization F --max-model-len L`: the large
model's prefill and decode workers run N ranks each and take the memory settings, the small
model's run one rank in its own window; on a host with GPUs each worker gets its own run of them
(CUDA_VISIBLE_DEVICES), too few failing before anything starts; on a CPU every rank gets a share
of the cores as torch threads."""

from __future__ import annotations

import os

import pytest
import torch

from tandem import cli
from tandem.config import ApiKey, Tier, load_settings, settings_flags
from tandem.devstack.devices import NotEnoughGpus, assign_gpus, host_gpus
from tandem.devstack.members import Member, StackConfig, service_member
from tandem.devstack.secrets import StackSecrets
from tandem.devstack.stack import stack_config_from
from tandem.errors import StartupError
from tandem.models.files import open_model
from tandem.models.tensor_parallel import check_split

KEYS = {"k": ApiKey(user_id="u", tier=Tier.PLUS)}
SECRETS = StackSecrets.generate()
EIGHT_GPUS = tuple(str(index) for index in range(8))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "TANDEM_TORCH_THREADS", "TANDEM_TENSOR_PARALLEL_SIZE", "TANDEM_MAX_MODEL_LEN", "TANDEM_DEVICE"):
        monkeypatch.delenv(name, raising=False)


def members(config: StackConfig) -> dict[str, Member]:
    def on_line(name: str, text: str) -> None:
        pass

    planned = [
        service_member(config, role, index, "nats://127.0.0.1:1", "redis://127.0.0.1:2/0", SECRETS, on_line, pool)
        for role, index, pool in config.planned()
    ]
    return {member.name: member for member in planned}


def stack(**fields) -> StackConfig:
    return StackConfig(**{"host": "127.0.0.1", "chat_port": 18080, "api_keys": KEYS, "extra_env": {}, **fields})


def config_of(*args: str) -> StackConfig:
    settings = load_settings(list(args), prog="tandem up")
    return stack_config_from(settings, chat_port=18080, flags={k: str(v) for k, v in settings_flags(list(args), "tandem up")().items()})


def test_workers_take_consecutive_runs_of_the_hosts_gpus_one_per_rank():
    ranks = {"prefill-0": 3, "decode-0": 3, "decode-1": 3, "small-decode-0": 1}
    assert assign_gpus(ranks, tuple(str(index) for index in range(10))) == {
        "prefill-0": "0,1,2",
        "decode-0": "3,4,5",
        "decode-1": "6,7,8",
        "small-decode-0": "9",
    }
    # ids as the host names them (its own CUDA_VISIBLE_DEVICES), not their positions
    assert assign_gpus({"prefill-0": 2, "decode-0": 2}, ("2", "3", "5", "7")) == {"prefill-0": "2,3", "decode-0": "5,7"}


def test_fewer_gpus_than_ranks_is_an_error_naming_what_each_worker_needs():
    with pytest.raises(NotEnoughGpus) as caught:
        assign_gpus({"prefill-0": 4, "decode-0": 4, "small-decode-0": 1}, EIGHT_GPUS)
    assert isinstance(caught.value, StartupError), "tandem up prints it as its one-line error"
    assert str(caught.value).startswith(
        "the workers need 9 GPUs, one per rank (prefill-0 4, decode-0 4, small-decode-0 1), and this host has 8"
    )


def test_each_worker_of_the_stack_gets_its_own_gpus_and_the_small_models_one_rank():
    config = stack(tensor_parallel_size=2, num_decode_workers=2, num_small_decode_workers=1, gpus=EIGHT_GPUS)
    planned = members(config)
    workers = {name: m.env for name, m in planned.items() if m.role in ("prefill", "decode")}
    assert {name: (env["CUDA_VISIBLE_DEVICES"], env["TANDEM_TENSOR_PARALLEL_SIZE"]) for name, env in workers.items()} == {
        "prefill": ("0,1", "2"),
        "decode-0": ("2,3", "2"),
        "decode-1": ("4,5", "2"),
        "small-decode-0": ("6", "1"),
    }
    for name in ("router", "relay", "chat"):
        assert "CUDA_VISIBLE_DEVICES" not in planned[name].env, name


def test_a_stack_on_a_host_with_too_few_gpus_plans_no_member():
    config = stack(tensor_parallel_size=4, num_small_decode_workers=1, gpus=EIGHT_GPUS)
    with pytest.raises(NotEnoughGpus, match="need 9 GPUs"):
        members(config)


def test_on_a_cpu_every_rank_of_every_worker_gets_a_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    one_rank = members(stack(num_small_decode_workers=1))
    # prefill, decode and small-decode, one rank each: 15 cores (one kept for the services) / 3 = 5 threads
    assert {m.env.get("TANDEM_TORCH_THREADS") for m in one_rank.values() if m.role in ("prefill", "decode")} == {"5"}
    three_ranks = members(stack(tensor_parallel_size=3, num_small_decode_workers=1))
    # prefill 3 + decode 3 + small-decode 1 = 7 ranks: 15 / 7 = 2 threads each
    assert {m.env["TANDEM_TORCH_THREADS"] for m in three_ranks.values() if m.role in ("prefill", "decode")} == {"2"}
    assert all("CUDA_VISIBLE_DEVICES" not in m.env for m in three_ranks.values())


def test_up_flags_reach_the_large_models_workers_and_the_small_model_keeps_one_rank_and_its_window():
    config = config_of("--tensor-parallel-size", "3", "--gpu-memory-utilization", "0.8", "--max-model-len", "4096", "--device", "cpu")
    assert config.tensor_parallel_size == 3
    assert "TANDEM_TENSOR_PARALLEL_SIZE" not in config.extra_env, "the stack sets it per worker"
    planned = members(config)
    settings = ("TANDEM_TENSOR_PARALLEL_SIZE", "TANDEM_GPU_MEMORY_UTILIZATION", "TANDEM_MAX_MODEL_LEN")
    assert {name: tuple(m.env.get(s) for s in settings) for name, m in planned.items() if m.role in ("prefill", "decode")} == {
        "prefill": ("3", "0.8", "4096"),
        "decode": ("3", "0.8", "4096"),
        "small-decode-0": ("1", "0.8", None),
    }


def test_the_tensor_parallel_size_from_the_environment_is_the_stacks_too(monkeypatch):
    monkeypatch.setenv("TANDEM_TENSOR_PARALLEL_SIZE", "2")
    monkeypatch.setenv("TANDEM_MAX_MODEL_LEN", "2048")
    planned = members(config_of("--device", "cpu"))
    assert [(m.env["TANDEM_TENSOR_PARALLEL_SIZE"], m.env.get("TANDEM_MAX_MODEL_LEN")) for m in planned.values() if m.role == "decode"] == [
        ("2", "2048"),
        ("1", None),
    ]


def test_extra_env_cannot_set_the_ranks_behind_the_stacks_back():
    with pytest.raises(ValueError, match="StackConfig.tensor_parallel_size"):
        stack(extra_env={"TANDEM_TENSOR_PARALLEL_SIZE": "2"})


def test_host_gpus_are_those_torch_sees_named_as_this_process_names_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert host_gpus("auto") == ("0", "1", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,GPU-x")  # torch counts what it can open
    assert host_gpus("auto") == ("4", "5", "6")
    assert host_gpus("cpu") == ()


def test_up_on_a_host_with_too_few_gpus_fails_before_anything_starts(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert cli.main(["up", "--tensor-parallel-size", "2", "--small-decode-workers", "1", "--prefill-workers", "1"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("tandem up: error: the workers need 5 GPUs, one per rank (prefill-0 2, decode-0 2, small-decode-0 1)"), error
    assert "\n" not in error
    config = config_of("--tensor-parallel-size", "2", "--small-decode-workers", "0", "--prefill-workers", "1")
    assert config.visible_gpus() == {"prefill-0": "0,1", "decode-0": "2,3"}


def test_device_cuda_without_a_gpu_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(StartupError, match="torch sees no CUDA GPU here"):
        config_of("--device", "cuda")


def test_up_refuses_a_size_the_model_does_not_split_over_before_anything_starts(capsys):
    # SmolLM2: 9 attention heads, 3 KV heads, an MLP of 1,536 rows
    assert cli.main(["up", "--tensor-parallel-size", "2", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("tandem up: error: TANDEM_TENSOR_PARALLEL_SIZE=2 does not split this model's 9 attention heads"), error
    check_split(open_model(None), 3)  # 3 heads each, one KV head each
