"""`tandem plan` from the command line: the issue's interface and JSON keys, the text worksheet,
custom and measured figures, the embedded SmolLM2 read through --model, and bad input as a
one-line error with exit status 2."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from tandem import cli

SEVENTY_B = [
    "--layers",
    "80",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--params",
    "70e9",
    "--dtype",
    "bf16",
    "--gpus-per-replica",
    "4",
    "--context-tokens",
    "2000",
]
TRAFFIC = ["--output-tokens-per-s", "50e6", "--prompt-tokens-per-s", "100e6"]
ISSUE_KEYS = (
    "kv_bytes_per_token", "kv_tokens_per_replica", "sequences_per_replica", "decode_step_ms_floor",
    "tokens_per_s_per_replica_floor", "prefill_tokens_per_s_per_gpu", "decode_gpus", "prefill_gpus",
    "total_gpus", "power_mw", "cost_per_day",
)  # fmt: skip


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `tandem plan argv`, argparse's own exits included."""
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as exited:
        code = exited.code
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *argv: str) -> dict:
    code, out, err = plan(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_the_issue_command_prints_every_documented_key_as_json(capsys):
    result = plan_json(capsys, *SEVENTY_B, "--gpu", "h100", *TRAFFIC)
    assert all(result[key] is not None for key in ISSUE_KEYS), {key: result[key] for key in ISSUE_KEYS}
    # the same figures as the hand worksheet in test_plan_worksheet.py
    assert (result["kv_bytes_per_token"], result["sequences_per_replica"], result["total_gpus"]) == (327_680, 225, 72_116)
    assert result["gpu"]["name"] == "H100 SXM 80 GB"
    assert result["formulas"]["weight_bytes"] == "70e9 params x 2 B (bf16)"


def test_h200_holds_more_sequences_and_needs_fewer_gpus_than_h100(capsys):
    h100 = plan_json(capsys, *SEVENTY_B, "--gpu", "h100", *TRAFFIC)
    h200 = plan_json(capsys, *SEVENTY_B, "--gpu", "h200", *TRAFFIC)
    # 4 x 141e9 x 90 % - 140e9 = 367.6e9 B of KV / 327,680 = 1,121,826 tokens -> 560 sequences
    assert h200["kv_tokens_per_replica"] == 1_121_826
    assert h200["sequences_per_replica"] == 560
    assert h200["decode_gpus"] < h100["decode_gpus"]


def test_the_text_worksheet_shows_each_line_with_its_substituted_formula(capsys):
    code, out, _ = plan(capsys, *SEVENTY_B, *TRAFFIC)
    assert code == 0
    lines = out.splitlines()
    kv_line = next(line for line in lines if line.strip().startswith("KV per token"))
    assert "327,680 B" in kv_line
    assert kv_line.endswith("= 2 (K and V) x 80 layers x 8 KV heads x 128 head dim x 2 B (bf16)")
    assert any(line.strip().startswith("facility power") and "MW" in line and "PUE" in line for line in lines)


def test_fp8_flag_halves_weights_and_kv_and_kv_dtype_overrides_it(capsys):
    bf16 = plan_json(capsys, *SEVENTY_B)
    fp8 = plan_json(capsys, *SEVENTY_B, "--dtype", "fp8")
    mixed = plan_json(capsys, *SEVENTY_B, "--dtype", "fp8", "--kv-dtype", "bf16")
    assert (fp8["weight_bytes"], fp8["kv_bytes_per_token"]) == (bf16["weight_bytes"] / 2, bf16["kv_bytes_per_token"] / 2)
    assert (mixed["weight_bytes"], mixed["kv_bytes_per_token"]) == (fp8["weight_bytes"], bf16["kv_bytes_per_token"])


def test_custom_gpu_numbers_drive_the_worksheet(capsys):
    result = plan_json(
        capsys, *SEVENTY_B, "--gpu", "custom", "--gpu-memory-gb", "100", "--gpu-bandwidth-gbs", "1000", "--gpu-tflops", "200"
    )
    # KV: 4 x 100e9 x 90 % - 140e9 = 220e9 B / 327,680 = 671,386 tokens -> 335 sequences
    assert (result["kv_tokens_per_replica"], result["sequences_per_replica"]) == (671_386, 335)
    # floor: (140e9 + 335 x 2000 x 327,680 = 359.5456e9) / (4 x 1e12) = 89.8864 ms
    assert result["decode_step_ms_floor"] == pytest.approx(89.8864)
    # prefill: 200e12 x 50 % / 140e9 = 714.29 tokens/s
    assert result["prefill_tokens_per_s_per_gpu"] == pytest.approx(714.2857, rel=1e-6)


def test_a_table_figure_can_be_replaced_by_a_flag(capsys):
    result = plan_json(capsys, *SEVENTY_B, "--gpu", "h100", "--gpu-memory-gb", "94")
    assert result["replica_memory_bytes"] == 4 * 94e9
    assert result["gpu"]["bandwidth_bytes_per_s"] == 3350e9


def test_settings_flags_change_the_assumptions(capsys):
    result = plan_json(capsys, *SEVENTY_B, *TRAFFIC, "--bandwidth-efficiency", "1", "--gpu-hour-price", "2", "--kw-per-server", "12")
    assert result["decode_step_ms"] == pytest.approx(result["decode_step_ms_floor"])
    assert result["cost_per_day"] == pytest.approx(result["total_gpus"] * 2 * 24)
    assert result["power_mw"] == pytest.approx(math.ceil(result["total_gpus"] / 8) * 12 * 1.3 / 1000)


def test_model_reads_the_embedded_smollm2_and_this_machines_measured_bandwidth_gives_a_finite_floor(capsys):
    result = plan_json(capsys, "--model", "--gpu", "cpu", "--measure-bandwidth", "--measure-flops", "--max-sequences", "64")
    model = result["model"]
    # 28,311,552 tied embedding + 30 x 3,540,096 per layer + 576 final norm = 134,515,008
    assert (model["num_layers"], model["num_kv_heads"], model["head_dim"], model["num_params"]) == (30, 3, 64, 134_515_008)
    assert model["context_window"] == 8192
    assert result["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * {"bf16": 2, "fp32": 4}[result["deployment"]["kv_dtype"]]
    bandwidth = result["gpu"]["bandwidth_bytes_per_s"]
    assert bandwidth > 0 and result["gpu"]["bf16_flops"] > 0
    assert math.isfinite(result["decode_step_ms_floor"]) and result["decode_step_ms_floor"] > 0
    assert result["decode_step_ms_floor"] == pytest.approx(1e3 * result["decode_bytes_per_step"] / bandwidth)
    assert math.isfinite(result["single_stream_step_ms_floor"]) and result["sequences_per_replica"] == 64


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "-80", *SEVENTY_B[2:]], "--layers"),
        ([*SEVENTY_B, "--params", "-70e9"], "--params"),
        ([*SEVENTY_B, "--gpu", "x100"], "x100"),
        ([*SEVENTY_B, "--gpus-per-replica", "-4"], "--gpus-per-replica"),
        ([*SEVENTY_B, "--output-tokens-per-s", "-1"], "--output-tokens-per-s"),
        ([*SEVENTY_B, "--bandwidth-efficiency", "1.5"], "--bandwidth-efficiency"),
        ([*SEVENTY_B, "--gpu", "custom", "--gpu-memory-gb", "100"], "--gpu-bandwidth-gbs"),
        ([*SEVENTY_B, "--gpu-memory-gb", "-1"], "--gpu-memory-gb"),
        ([*SEVENTY_B, "--gpu", "h100", "--measure-bandwidth"], "--gpu cpu"),
        ([*SEVENTY_B, "--gpus-per-replica", "1"], "--gpus-per-replica"),  # 140 GB of weights, one 80 GB GPU
        (["--layers", "80", "--params", "70e9"], "--kv-heads"),
        (["--model", "/nonexistent/model.gguf"], "no such file"),
        ([*SEVENTY_B, "--params", "seventy"], "--params"),
        ([*SEVENTY_B, "--params", "inf"], "--params"),
    ],
)
def test_bad_input_is_a_one_line_error_with_exit_status_2(capsys, argv, message):
    code, out, err = plan(capsys, *argv)
    assert code == 2
    assert out == ""
    assert message in err
    assert "Traceback" not in err


def test_model_reads_a_safetensors_folder_shape_dtype_and_parameter_count(capsys, tmp_path):
    config = {
        "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
        "torch_dtype": "float16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    # 100 x 64 embedding (6,400) + 2 layers x 64 x 32 k_proj (2 x 2,048): 10,496 parameters, read from shapes alone
    tensors = {"model.embed_tokens.weight": torch.zeros(100, 64, dtype=torch.float16)}
    tensors |= {f"model.layers.{i}.self_attn.k_proj.weight": torch.zeros(32, 64, dtype=torch.float16) for i in range(2)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    result = plan_json(capsys, "--model", str(tmp_path), "--gpu", "l40s")
    assert result["model"] | {"name": None} == {
        "name": None, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "num_params": 10_496, "dtype": "fp16", "context_window": 4096,
    }  # fmt: skip
    # 2 x 2 layers x 2 KV heads x 16 head dim x 2 B (fp16) = 256 B
    assert (result["deployment"]["weight_dtype"], result["kv_bytes_per_token"]) == ("fp16", 256)


def test_the_replica_is_deployed_with_its_gpus_as_ranks_and_what_the_reserve_leaves_as_memory_share(capsys):
    result = plan_json(capsys, *SEVENTY_B[:-4], "--gpus-per-replica", "8", "--context-tokens", "2000", "--runtime-reserve", "0.2")
    # KV: 8 x 80e9 x 80 % - 140e9 = 372e9 B / 327,680 = 1,135,253 tokens
    assert result["deploy"] == {
        "tensor_parallel_size": 8,
        "gpu_memory_utilization": 0.8,
        "max_model_len_at_most": 1_135_253,
        "quantization": "none",
        "kv_cache_dtype": "auto",
    }
    assert result["deploy"]["max_model_len_at_most"] == result["kv_tokens_per_replica"]


def test_a_replica_sized_with_fp8_is_deployed_with_fp8_weights_and_kv_cache(capsys):
    fp8 = plan_json(capsys, *SEVENTY_B, "--dtype", "fp8")["deploy"]
    mixed = plan_json(capsys, *SEVENTY_B, "--dtype", "fp8", "--kv-dtype", "bf16")["deploy"]
    assert (fp8["quantization"], fp8["kv_cache_dtype"]) == ("fp8", "fp8")
    assert (mixed["quantization"], mixed["kv_cache_dtype"]) == ("fp8", "auto")
    assert cli.main(["plan", *SEVENTY_B, "--dtype", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "--quantization" in text and "--kv-cache-dtype" in text
