"""bench/tp_agreement.py runs end to end on 2 prompts of 8 tokens: SmolLM2 over 3 ranks answers what
one rank does in float32, and in bfloat16 the JSON says how the answers compare, with the one-rank
logits at each divergence."""

import json
import subprocess
import sys

import pytest
from helpers import REPO


def test_tp_agreement_bench_finds_fp32_identical_and_reports_bf16_with_its_divergences(tmp_path):
    out = tmp_path / "agreement.json"
    command = [sys.executable, str(REPO / "bench" / "tp_agreement.py"), "--prompts", "2", "--max-tokens", "8", "--threads", "1"]
    result = subprocess.run([*command, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["tensor_parallel_size"] == 3 and set(report["dtypes"]) == {"fp32", "bf16"}
    fp32, bf16 = report["dtypes"]["fp32"], report["dtypes"]["bf16"]
    assert fp32["num_identical"] == fp32["num_prompts"] == 2 and fp32["identical_share"] == 1.0
    assert fp32["mean_first_divergence"] is None
    assert bf16["num_prompts"] == 2 and bf16["identical_share"] == pytest.approx(bf16["num_identical"] / 2)
    splits = [row["divergence"] for row in bf16["prompts"] if not row["is_identical"]]
    assert len(splits) == 2 - bf16["num_identical"]
    for split in splits:  # the one-rank model's two likeliest tokens there, and the float32 model's gap beside
        assert 0 <= split["position"] < 8 and split["token_one_rank"] != split["token_tensor_parallel"]
        assert split["top2_gap"] == pytest.approx(split["top2_logits"][0] - split["top2_logits"][1]) and split["top2_gap"] >= 0
        assert split["fp32_top2_gap"] is not None and split["fp32_top2_gap"] >= 0
    if splits:
        assert bf16["mean_first_divergence"] == pytest.approx(sum(s["position"] for s in splits) / len(splits))
    assert report["env"]["cpu"]["cpus"] > 0
