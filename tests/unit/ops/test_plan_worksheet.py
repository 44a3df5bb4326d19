"""The capacity worksheet's arithmetic against values worked out by hand (the working is in the
comments), for a 70B-class model on H100s and for SmolLM2-135M on a custom accelerator."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tandem.errors import StartupError
from tandem.ops.gpus import GPUS, Gpu
from tandem.ops.model_shape import ModelShape
from tandem.ops.plan_inputs import Assumptions, Deployment, Traffic
from tandem.ops.worksheet import compute

LLAMA_70B = ModelShape(name="70B", num_layers=80, num_kv_heads=8, head_dim=128, num_params=70_000_000_000, dtype="bf16")
SMOLLM2 = ModelShape(name="SmolLM2-135M", num_layers=30, num_kv_heads=3, head_dim=64, num_params=134_515_008, dtype="bf16")
# 10 GB, 20 GB/s, 0.5 TFLOP/s: round numbers, so the hand working stays readable
SMALL_GPU = Gpu("custom", 10e9, 20e9, 0.5e12, 0.5e12, None, None, "test")
ISSUE_TRAFFIC = Traffic(output_tokens_per_s=50e6, prompt_tokens_per_s=100e6)


def test_70b_on_four_h100s_matches_the_hand_worksheet():
    sheet = compute(LLAMA_70B, GPUS["h100"], Deployment(gpus_per_replica=4, context_tokens=2000), ISSUE_TRAFFIC, Assumptions())
    # weights: 70e9 params x 2 B = 140e9 B
    assert sheet.weight_bytes == 140e9
    # KV per token: 2 x 80 layers x 8 KV heads x 128 head dim x 2 B = 327,680 B
    assert sheet.kv_bytes_per_token == 327_680
    # replica: 4 x 80e9 = 320e9 B; reserve 10 % = 32e9; left for KV: 320e9 - 32e9 - 140e9 = 148e9 B
    assert sheet.replica_memory_bytes == 320e9
    assert sheet.runtime_reserve_bytes == pytest.approx(32e9)
    assert sheet.kv_bytes_per_replica == pytest.approx(148e9)
    # KV tokens: floor(148e9 / 327,680) = 451,660 (327,680 x 451,660 = 147,999,948,800; 51,200 B left)
    assert sheet.kv_tokens_per_replica == 451_660
    # sequences: floor(451,660 / 2000) = 225
    assert sheet.sequences_per_replica == 225
    # bytes per step: 140e9 + 225 x 2000 x 327,680 = 140e9 + 147,456,000,000 = 287,456,000,000
    assert sheet.decode_bytes_per_step == 287_456_000_000
    # floor: 287.456e9 B / (4 x 3.35e12 B/s = 13.4e12) = 21.45194 ms; at 60 %: 35.75323 ms
    assert sheet.decode_step_ms_floor == pytest.approx(21.45194, rel=1e-6)
    assert sheet.decode_step_ms_memory == pytest.approx(35.75323, rel=1e-6)
    # compute: 2 x 70e9 x 225 = 31.5e12 FLOP / (4 x 989e12 x 50 % = 1.978e15) = 15.92518 ms: memory-bound
    assert sheet.decode_flops_per_step == 31.5e12
    assert sheet.decode_step_ms_compute == pytest.approx(15.92518, rel=1e-6)
    assert (sheet.decode_step_ms, sheet.decode_bound) == (sheet.decode_step_ms_memory, "memory")
    # one sequence alone: (140e9 + 2000 x 327,680 = 140.65536e9) / 13.4e12 = 10.49667 ms
    assert sheet.single_stream_step_ms_floor == pytest.approx(10.49667, rel=1e-6)
    # per stream: 1000 / 21.45194 = 46.6158; 1000 / 35.75323 = 27.9695 tokens/s
    assert sheet.tokens_per_s_per_stream_floor == pytest.approx(46.6158, rel=1e-5)
    assert sheet.tokens_per_s_per_stream == pytest.approx(27.9695, rel=1e-5)
    # per replica: 225 x 46.6158 = 10,488.56; 225 x 27.9695 = 6,293.13 tokens/s
    assert sheet.tokens_per_s_per_replica_floor == pytest.approx(10_488.56, rel=1e-5)
    assert sheet.tokens_per_s_per_replica == pytest.approx(6_293.13, rel=1e-5)
    # prefill: 989e12 x 50 % / (2 x 70e9) = 3,532.14 tokens/s per GPU
    assert sheet.prefill_tokens_per_s_per_gpu == pytest.approx(3_532.14, rel=1e-5)


def test_70b_fleet_power_and_cost_match_the_hand_worksheet():
    sheet = compute(LLAMA_70B, GPUS["h100"], Deployment(gpus_per_replica=4, context_tokens=2000), ISSUE_TRAFFIC, Assumptions())
    # decode: ceil(50e6 x 1.2 / 6,293.13 = 9,534.2) = 9,535 replicas x 4 = 38,140 GPUs
    assert (sheet.decode_replicas, sheet.decode_gpus) == (9_535, 38_140)
    # prefill: ceil(100e6 x 1.2 / (3,532.14 x 4 = 14,128.57) = 8,493.4) = 8,494 replicas x 4 = 33,976 GPUs
    assert (sheet.prefill_replicas, sheet.prefill_gpus) == (8_494, 33_976)
    # 38,140 + 33,976 = 72,116 GPUs; ceil(72,116 / 8) = 9,015 servers
    assert (sheet.total_gpus, sheet.servers) == (72_116, 9_015)
    # 8 x 700 W x 1.8 = 10.08 kW a server; 9,015 x 10.08 kW x 1.3 PUE = 118,132.56 kW
    assert sheet.kw_per_server == pytest.approx(10.08)
    assert sheet.power_mw == pytest.approx(118.13256)
    # 72,116 GPUs x $3.00 = $216,348 an hour, x 24 = $5,192,352 a day
    assert sheet.cost_per_hour == pytest.approx(216_348)
    assert sheet.cost_per_day == pytest.approx(5_192_352)
    # full use: 9,535 x 6,293.13 = 60,005,000 tokens/s; $216,348 / (60.005e6 x 3600) x 1e6 = $1.0015 per Mtok; / 50 % = $2.003
    assert sheet.fleet_output_tokens_per_s == pytest.approx(60_005_000, rel=1e-5)
    assert sheet.cost_per_million_output_tokens_full_use == pytest.approx(1.0015, rel=1e-4)
    assert sheet.cost_per_million_output_tokens_average == pytest.approx(2.0030, rel=1e-4)


def test_smollm2_on_a_custom_accelerator_matches_the_hand_worksheet():
    sheet = compute(SMOLLM2, SMALL_GPU, Deployment(context_tokens=2000), Traffic(), Assumptions())
    # weights: 134,515,008 x 2 B = 269,030,016 B; KV per token: 2 x 30 x 3 x 64 x 2 B = 23,040 B
    assert (sheet.weight_bytes, sheet.kv_bytes_per_token) == (269_030_016, 23_040)
    # KV memory: 10e9 - 1e9 - 269,030,016 = 8,730,969,984 B
    assert sheet.kv_bytes_per_replica == pytest.approx(8_730_969_984)
    # KV tokens: floor(8,730,969,984 / 23,040) = 378,948 (23,040 x 378,948 = 8,730,961,920); sequences: floor(/2000) = 189
    assert (sheet.kv_tokens_per_replica, sheet.sequences_per_replica) == (378_948, 189)
    # step bytes: 269,030,016 + 189 x 2000 x 23,040 = 8,978,150,016; / 20e9 B/s = 448.90750 ms; / 60 % = 748.17917 ms
    assert sheet.decode_bytes_per_step == 8_978_150_016
    assert sheet.decode_step_ms_floor == pytest.approx(448.90750, rel=1e-7)
    assert sheet.decode_step_ms == pytest.approx(748.17917, rel=1e-7)
    # compute: 2 x 134,515,008 x 189 = 50,846,673,024 FLOP / (0.5e12 x 50 %) = 203.38669 ms: memory-bound
    assert sheet.decode_step_ms_compute == pytest.approx(203.38669, rel=1e-7)
    assert sheet.decode_bound == "memory"
    # one sequence: (269,030,016 + 2000 x 23,040) / 20e9 = 15.75550 ms
    assert sheet.single_stream_step_ms_floor == pytest.approx(15.75550, rel=1e-6)
    # prefill: 0.5e12 x 50 % / (2 x 134,515,008) = 929.26 tokens/s
    assert sheet.prefill_tokens_per_s_per_gpu == pytest.approx(929.26, rel=1e-5)
    # no traffic given: no fleet
    assert sheet.decode_gpus is None and sheet.total_gpus is None and sheet.cost_per_day is None


def test_compute_bound_decode_takes_the_compute_step():
    # 64 sequences of 350 tokens: 269,030,016 + 64 x 350 x 23,040 = 785,126,016 B / 20e9 = 39.256 ms / 60 % = 65.427 ms;
    # compute 2 x 134,515,008 x 64 = 17,217,921,024 / 0.25e12 = 68.872 ms > 65.427: compute-bound
    sheet = compute(SMOLLM2, SMALL_GPU, Deployment(context_tokens=350, max_sequences=64), Traffic(), Assumptions())
    assert sheet.sequences_per_replica == 64
    assert sheet.decode_bound == "compute"
    assert sheet.decode_step_ms == pytest.approx(68.87168, rel=1e-6)


def test_fp8_halves_weight_and_kv_bytes_and_doubles_prefill_on_h100():
    bf16 = compute(LLAMA_70B, GPUS["h100"], Deployment(gpus_per_replica=4), Traffic(), Assumptions())
    fp8 = compute(LLAMA_70B, GPUS["h100"], Deployment(gpus_per_replica=4, weight_dtype="fp8", kv_dtype="fp8"), Traffic(), Assumptions())
    assert fp8.weight_bytes == bf16.weight_bytes / 2 == 70e9
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token / 2 == 163_840
    # 1979e12 x 50 % / 140e9 = 7,067.86 tokens/s
    assert fp8.prefill_tokens_per_s_per_gpu == pytest.approx(7_067.86, rel=1e-5)
    # KV memory: 320e9 - 32e9 - 70e9 = 218e9 B; / 163,840 = 1,330,566 tokens -> 665 sequences
    assert (fp8.kv_tokens_per_replica, fp8.sequences_per_replica) == (1_330_566, 665)


def test_fp8_weights_with_a_bf16_kv_cache_halve_only_the_weights():
    sheet = compute(LLAMA_70B, GPUS["h100"], Deployment(gpus_per_replica=4, weight_dtype="fp8", kv_dtype="bf16"), Traffic(), Assumptions())
    assert (sheet.weight_bytes, sheet.kv_bytes_per_token) == (70e9, 327_680)


def test_a_gpu_without_fp8_tensor_cores_computes_fp8_weights_at_its_bf16_rate():
    sheet = compute(LLAMA_70B, GPUS["a100"], Deployment(gpus_per_replica=4, weight_dtype="fp8"), Traffic(), Assumptions())
    assert sheet.prefill_tokens_per_s_per_gpu == pytest.approx(312e12 * 0.5 / 140e9)


def test_every_value_has_one_line_whose_formula_carries_the_numbers():
    sheet = compute(LLAMA_70B, GPUS["h100"], Deployment(gpus_per_replica=4), ISSUE_TRAFFIC, Assumptions())
    keys = [line.key for line in sheet.lines]
    assert len(keys) == len(set(keys))
    assert set(keys) == {k for k, v in sheet.values().items() if v is not None} - {"decode_bound"}
    formulas = sheet.formulas()
    assert formulas["kv_bytes_per_token"] == "2 (K and V) x 80 layers x 8 KV heads x 128 head dim x 2 B (bf16)"
    assert formulas["sequences_per_replica"] == "floor(451,660 tokens / 2,000 context tokens)"
    assert formulas["decode_gpus"] == "9,535 x 4"


@pytest.mark.parametrize(
    ("deployment", "assumptions", "names"),
    [
        (Deployment(gpus_per_replica=1), Assumptions(), "--gpus-per-replica"),  # 140 GB of weights on one 80 GB GPU
        (Deployment(gpus_per_replica=0), Assumptions(), "--gpus-per-replica"),
        (Deployment(gpus_per_replica=4, context_tokens=500_000), Assumptions(), "--context-tokens"),
        (Deployment(gpus_per_replica=4, weight_dtype="int3"), Assumptions(), "--dtype"),
    ],
)
def test_a_deployment_that_cannot_work_is_a_startup_error_naming_the_flag(deployment, assumptions, names):
    with pytest.raises(StartupError, match=names):
        compute(LLAMA_70B, GPUS["h100"], deployment, Traffic(), assumptions)


def test_a_context_longer_than_the_models_window_is_refused():
    with pytest.raises(StartupError, match="--context-tokens 10000 is longer than SmolLM2-135M's window of 8192"):
        compute(dataclasses.replace(SMOLLM2, context_window=8192), SMALL_GPU, Deployment(context_tokens=10_000), Traffic(), Assumptions())


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"bandwidth_efficiency": 0.0}, "--bandwidth-efficiency"),
        ({"compute_efficiency": 1.5}, "--compute-efficiency"),
        ({"runtime_reserve": -0.1}, "--runtime-reserve"),
        ({"headroom": -1.0}, "--headroom"),
        ({"pue": 0.9}, "--pue"),
        ({"average_busyness": math.nan}, "--average-busyness"),
        ({"kw_per_server": 0.0}, "--kw-per-server"),
    ],
)
def test_assumptions_out_of_range_are_refused_by_flag(change, flag):
    with pytest.raises(StartupError, match=flag):
        dataclasses.replace(Assumptions(), **change)
