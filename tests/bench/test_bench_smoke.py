"""The benches run end to end at smoke sizes and write the JSON their readers rely on.

No timing is asserted (speed is read from the benches' tables, against baselines measured in the
same run). One torch thread: these check that the benches work, and on a shared machine more
threads than free cores make every torch op wait on a descheduled thread.
"""

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

ENGINE_KEYS = (
    "tokens_per_s", "hf_tokens_per_s", "ratio_vs_hf", "roofline_tokens_per_s", "roofline_fraction", "tpot_b1_ms",
    "memory_floor_ms", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms", "peak_flops",
    "copy_bandwidth_bytes_per_s", "roofline_decode_only_tokens_per_s", "weight_bytes", "flops_per_token", "targets",
)  # fmt: skip
HAS_HF = all(importlib.util.find_spec(name) is not None for name in ("transformers", "accelerate"))


def _bench(script: str, out: Path, *args: str, is_engine_only: bool = True) -> dict:
    """`script --quick`'s JSON report; an engine-only bench runs on one thread (the stack benches
    take no --threads)."""
    threads = ["--threads", "1"] if is_engine_only else []
    command = [sys.executable, str(REPO / "bench" / script), "--quick", *threads, "--out", str(out), *args]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "PASS" in result.stdout or "MISS" in result.stdout  # the table shows its targets
    return json.loads(out.read_text())


def _is_positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


PEER = {"tokens_per_s": 10.0, "num_requests": 4, "output_tokens": 4 * 16, "tpot_b1_ms": 50.0}  # vllm_same.py's shape, for batch 4


@pytest.fixture(scope="module")
def engine_report(tmp_path_factory) -> dict:
    """One --quick --skip-hf run of the engine bench, with a peer's JSON beside it, for the tests
    below to read (a run is most of a minute here: one, not one per test)."""
    folder = tmp_path_factory.mktemp("engine-bench")
    peer = folder / "peer.json"
    peer.write_text(json.dumps(PEER))
    return _bench("engine.py", folder / "engine.json", "--skip-hf", "--peer", str(peer))


def test_engine_bench_without_hf_reports_throughput_latency_and_roofline(engine_report):
    result = engine_report
    assert set(ENGINE_KEYS) <= result.keys()
    for key in ("tokens_per_s", "roofline_tokens_per_s", "roofline_fraction", "tpot_b1_ms", "memory_floor_ms",
                "ttft_p50_ms", "tpot_p50_ms", "peak_flops", "copy_bandwidth_bytes_per_s", "weight_bytes"):  # fmt: skip
        assert _is_positive(result[key]), (key, result[key])
    assert result["hf_tokens_per_s"] is None and result["ratio_vs_hf"] is None
    assert result["ttft_p95_ms"] >= result["ttft_p50_ms"] and result["tpot_p95_ms"] >= result["tpot_p50_ms"]
    assert result["roofline_fraction"] == pytest.approx(result["tokens_per_s"] / result["roofline_tokens_per_s"])
    assert result["workload"]["num_requests"] == 8 and result["workload"]["num_output_tokens"] == 16
    assert result["engine_preemptions"] == 0  # the KV cache is sized to hold the whole batch
    assert result["tensor_parallel_size"] == 1 and result["env"]["threads_per_rank"] == result["env"]["threads"] == 1
    assert result["env"]["cpu"]["cpus"] > 0 and isinstance(result["env"]["cpu"]["flags"], list)


def test_engine_bench_over_three_ranks_reports_its_size_and_its_figures(tmp_path):
    """SmolLM2 splits over 3 ranks (9 heads, 3 KV heads): rank 0 here, two rank processes, one
    torch thread each; smaller than --quick (one variant, one batch size) to stay seconds."""
    result = _bench(
        "engine.py", tmp_path / "tp3.json", "--skip-hf", "--tensor-parallel-size", "3", "--quantization", "none",
        "--requests", "4", "--batches", "4", "--output-tokens", "8", "--b1-tokens", "4", "--prefill-tokens", "64",
        "--prompt-tokens", "40", "80",
    )  # fmt: skip
    assert result["tensor_parallel_size"] == 3 and result["env"]["threads_per_rank"] == 1
    for key in ("tokens_per_s", "tpot_b1_ms", "ttft_p50_ms", "tpot_p50_ms", "roofline_fraction", "weight_bytes"):
        assert _is_positive(result[key]), (key, result[key])
    assert set(result["variants"]) == {"none"} and result["workload"]["num_requests"] == 4
    assert _is_positive(result["prefill"]["tokens_per_s"]) and result["engine_preemptions"] == 0


def test_engine_bench_dumps_the_peers_input_for_all_and_for_batch_4(tmp_path):
    prompts = tmp_path / "prompts.json"
    dump = subprocess.run([sys.executable, str(REPO / "bench" / "engine.py"), "--quick", "--dump-prompts", str(prompts)], cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert dump.returncode == 0, dump.stderr[-2000:]
    dumped = json.loads(prompts.read_text())
    assert dumped["n"] == len(dumped["prompts"]) == 8 and all(isinstance(t, int) for t in dumped["prompts"][0])
    first_four = json.loads((tmp_path / "prompts-b4.json").read_text())  # the peer's input for batch 4
    assert first_four["n"] == 4 and first_four["prompts"] == dumped["prompts"][:4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts-b4.json", "prompts.json"]  # none for batch 1


def test_engine_bench_reports_each_batch_size_and_variant_the_prefill_and_the_peer_beside_them(engine_report):
    """--quick runs batches 1, 4 and 8 on bf16 and int8; the peer's JSON (for batch 4) is read and
    each variant's tokens/s set against it."""
    result = engine_report
    assert set(result["variants"]) == {"none", "int8"}
    for name, variant in result["variants"].items():
        assert sorted(int(b) for b in variant["batches"]) == [1, 4, 8], name
        assert all(_is_positive(row["tokens_per_s"]) for row in variant["batches"].values())
        prefill = variant["prefill"]
        assert prefill["num_tokens"] == 256 and prefill["of_peak"] == pytest.approx(prefill["flops_per_s"] / result["peak_flops"])
        # the prefill's best round is its TTFT; each round's rate over the peak measured around it, the median
        rounds = prefill["rounds"]
        assert len(rounds) == 3 and all(_is_positive(r["peak_flops"]) and 0 < r["torch_flops"] <= r["peak_flops"] for r in rounds)
        assert min(r["seconds"] for r in rounds) == pytest.approx(prefill["ttft_ms"] / 1e3)
        flops = prefill["flops_per_s"] * prefill["ttft_ms"] / 1e3
        assert prefill["of_peak_paired"] == pytest.approx(statistics.median(flops / r["seconds"] / r["peak_flops"] for r in rounds))
        assert prefill["of_torch_peak_paired"] == pytest.approx(statistics.median(flops / r["seconds"] / r["torch_flops"] for r in rounds))
        assert prefill["of_torch_peak"] == pytest.approx(prefill["flops_per_s"] / result["matmul_flops"]["torch"])
        ratio = result["targets"][f"{name}_vs_peer_b4"]["ratio"]
        assert ratio == pytest.approx(variant["batches"]["4"]["tokens_per_s"] / PEER["tokens_per_s"])
        assert result["targets"][f"{name}_tpot_b1_vs_peer"]["ratio"] == pytest.approx(variant["tpot_b1_ms"] / PEER["tpot_b1_ms"])
    assert result["variants"]["int8"]["weight_bytes"] < result["variants"]["none"]["weight_bytes"]
    assert result["batches"]["8"]["tokens_per_s"] == pytest.approx(result["tokens_per_s"])  # the headline is the batch of all


@pytest.mark.skipif(not HAS_HF, reason="the HF baseline needs the bench extra: pip install -e '.[bench]'")
def test_engine_bench_measures_the_hf_baseline_at_each_batch_size(tmp_path):
    result = _bench(
        "engine.py", tmp_path / "engine.json", "--requests", "2", "--output-tokens", "4", "--hf-batches", "1:1,2:2", "--batches", "1,2"
    )
    assert [(run["batch_size"], run["num_requests"]) for run in result["hf_runs"]] == [(1, 1), (2, 2)]
    assert all(_is_positive(run["tokens_per_s"]) for run in result["hf_runs"])
    assert result["hf_tokens_per_s"] == max(run["tokens_per_s"] for run in result["hf_runs"])
    assert result["ratio_vs_hf"] == pytest.approx(result["tokens_per_s"] / result["hf_tokens_per_s"])


def test_prefix_cache_bench_serves_turn_2_from_the_cache(tmp_path):
    result = _bench("prefix_cache.py", tmp_path / "prefix.json")
    assert _is_positive(result["cold_ttft_ms"]) and _is_positive(result["warm_ttft_ms"])
    assert result["warm_over_cold"] == pytest.approx(result["warm_ttft_ms"] / result["cold_ttft_ms"])
    # the history is cached, the new message is not
    assert result["num_history_tokens"] - 16 < result["num_cached_tokens"] < result["num_prompt_tokens"]


def test_kv_transfer_bench_reports_the_handoff_against_raw_ucxx_and_remote_minus_local_ttft(tmp_path):
    result = _bench("kv_transfer.py", tmp_path / "kv.json")
    for key in ("handoff_bytes_per_s", "raw_ucxx_bytes_per_s", "ratio", "local_ttft_ms", "remote_ttft_ms"):
        assert _is_positive(result[key]), (key, result[key])
    assert result["is_verified"]
    # the same blocks between groups of 1 and of 3 ranks: a block is 3 views of a KV head each, verified at the decode side
    groups = result["by_tensor_parallel_size"]
    assert set(groups) == {"1", "3"} and result["tensor_parallel_size"] == 1
    assert groups["1"]["handoff_bytes_per_s"] == result["handoff_bytes_per_s"]
    assert groups["3"]["num_views"] == 3 * result["num_blocks"] and 3 * groups["3"]["bytes_per_view"] == result["bytes_per_block"]
    assert all(group["is_verified"] and _is_positive(group["handoff_bytes_per_s"]) for group in groups.values())
    assert result["remote_minus_local_ttft_ms"] == pytest.approx(result["remote_ttft_ms"] - result["local_ttft_ms"])
    assert result["remote_minus_local_second_token_ms"] == pytest.approx(result["remote_second_token_ms"] - result["local_second_token_ms"])


def test_stream_fanout_bench_holds_its_streams_delivers_every_event_and_answers_503_past_capacity(tmp_path):
    report = _bench("stream_fanout.py", tmp_path / "streams.json", "--env", "TANDEM_KV_CACHE_MIB=128", is_engine_only=False)
    requested = report["streams_requested"]
    assert report["streams_answered_200"] == report["streams_complete"] == requested, report
    assert 0 < report["chat_peak"]["held"] <= requested and report["events_delivered"] >= requested * 3
    assert _is_positive(report["delay_p99_ms"]) and report["delay_p99_ms"] >= report["delay_p50_ms"]
    assert report["chat_peak"]["fds"] > report["chat_baseline"]["fds"] and report["rss_bytes_per_stream"] >= 0
    capacity = report["capacity_phase"]
    answers = capacity["answers"]
    assert answers["500"] == answers["other"] == 0 and answers["200"] + answers["503"] == capacity["requested"], capacity
    assert answers["503"] == capacity["with_retry_after"]["503"] > 0, capacity
    # every stream holds its slot until all are answered; a --quick reply that ends during the
    # phase frees its streams' slots, each for one more 200
    freed = capacity["done_200s"] + capacity["ended_by_server_200s"]
    assert answers["200"] <= capacity["capacity"] + freed and capacity["capped_chat"]["streams_open"] <= capacity["capacity"], capacity


def test_routing_bench_splits_the_mix_over_both_models_and_prices_it_against_all_large(tmp_path):
    report = _bench("routing.py", tmp_path / "routing.json", "--env", "TANDEM_KV_CACHE_MIB=64", is_engine_only=False)
    models, baseline = report["models"], report["baseline"]
    assert sum(row["share"] for row in models.values()) == pytest.approx(1.0)
    assert sum(row["messages"] for row in models.values()) == report["messages"] == baseline["messages"] == 6
    # the quick mix has greetings and code questions: auto uses both models, the baseline only the large one
    assert set(models) == {report["large_model"], report["small_model"]}, models
    assert baseline["model"] == report["large_model"] and baseline["answered_by"] == {report["large_model"]: 6}
    for row in (*models.values(), report["aggregate"], baseline):
        assert _is_positive(row["cost_per_1000_messages"]) and _is_positive(row["output_tokens_per_s"]), row
    assert report["cost_ratio_auto_over_baseline"] == pytest.approx(
        report["aggregate"]["cost_per_1000_messages"] / baseline["cost_per_1000_messages"]
    )
    # the large model is greedy and on the same stack in both runs: its auto answers are the baseline's
    large = models[report["large_model"]]
    assert large["same_text_as_baseline"] == large["messages"], large
    assert _is_positive(report["safety"]["output_ms_per_token"]) and _is_positive(report["safety"]["input_ms_mean"])


def test_overload_bench_reports_each_tier_and_where_the_admitted_replies_spent_their_time(tmp_path):
    result = _bench("overload.py", tmp_path / "overload.json", is_engine_only=False)
    tiers = result["tiers"]
    assert set(tiers) == {"paid", "free"} and sum(t["sent"] for t in tiers.values()) > 0
    for tier in tiers.values():
        assert tier["sent"] == tier["admitted"] + tier["refused_429"] + tier["refused_503"] + tier["refused_other"]
        assert tier["timed_out"] == 0 and tier["refused_without_retry_after"] == 0
    assert result["targets"]["no_timeouts"] and result["targets"]["every_refusal_has_retry_after"]
    stages = result["stages"]
    assert stages["engine queue, paid"]["count"] >= tiers["paid"]["completed"]  # every admitted reply went through the engine
    assert stages["chat TTFT, paid"]["count"] >= tiers["paid"]["completed"]
    steps = sum(stages[row]["count"] for row in ("step, decode only", "step, mixed", "step, prefill only"))
    assert steps > 0 and _is_positive(result["unloaded_paid_ttft_p95_s"])
    # the paid-alone phase is broken down the same way, and each phase's CPU by process: the engine
    # process (started by the decode worker) computed in both, within what the phase's wall time allows
    assert result["paid_alone_stages"]["chat TTFT, paid"]["count"] >= result["paid_alone"]["completed"] > 0
    for phase in ("overload", "paid_alone"):
        cpu = result["cpu_s"][phase]
        assert (
            _is_positive(cpu["decode, started by it"]) and cpu["decode, started by it"] <= cpu["(the phase's wall time)"] * os.cpu_count()
        )
        assert {"chat", "relay", "router", "nats", "redis", "bench (the clients)"} <= set(cpu), cpu
        engine = result["engine"][phase]
        assert engine["prompt_tokens_computed"] > 0 and engine["output_tokens"] > 0, engine
        assert 0 <= engine["prefix_hit_tokens"] <= engine["prefix_query_tokens"], engine


def test_stack_overhead_bench_times_the_same_replies_through_the_stack_and_on_the_engine_alone(tmp_path):
    result = _bench("stack_overhead.py", tmp_path / "overhead.json", "--env", "TANDEM_KV_CACHE_MIB=64", is_engine_only=False)
    rounds = result["rounds"]
    assert result["num_requests"] == len(rounds) == 3 and result["max_tokens"] == 16
    assert result["quantization"] == "none"  # the large model's decode worker, not the small model's int8 one
    for name in ("stack", "engine"):
        side = result[name]
        assert all(_is_positive(side[key]) for key in ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms")), side
        assert side["ttft_p95_ms"] >= side["ttft_p50_ms"] and side["tpot_p95_ms"] >= side["tpot_p50_ms"]
    # greedy on the same prompt ids: as many tokens on both sides, and the stack counted the prompt the engine was given
    for pair in rounds:
        assert 1 < pair["stack"]["num_tokens"] == pair["engine"]["num_tokens"] <= 16, pair
        assert pair["stack"]["num_prompt_tokens"] == pair["engine"]["num_prompt_tokens"] == result["num_prompt_tokens"], pair
    assert result["tokens_equal"] and result["prompt_tokens_equal"]
    assert result["tpot_ratio"] == pytest.approx(result["stack"]["tpot_p50_ms"] / result["engine"]["tpot_p50_ms"])
    assert result["ttft_diff_ms"] == pytest.approx(result["stack"]["ttft_p50_ms"] - result["engine"]["ttft_p50_ms"])
    # every timed reply went through chat, and each of its tokens after the first through a decode step of the worker
    stages = result["stages"]
    assert stages["chat: arrival to first content written"]["count"] == len(rounds)
    decode_steps = stages["worker: step, decode only"]["count"] + stages["worker: step, mixed"]["count"]
    assert decode_steps >= sum(pair["stack"]["num_tokens"] - 1 for pair in rounds)


def test_structured_output_bench_reports_compile_and_mask_step_costs_at_batch_1_and_32(tmp_path):
    result = _bench("structured_output.py", tmp_path / "structured_output.json")
    assert result["vocab_size"] == 49152
    llguidance = {row["batch"]: row for row in result["rows"] if row["library"] == "llguidance"}
    assert set(llguidance) == {1, 32}
    for row in llguidance.values():
        assert _is_positive(row["compile_ms"]) and _is_positive(row["step_ms"]) and row["best_step_ms"] <= row["step_ms"]


def test_token_path_bench_logs_every_event_every_way_and_prices_each_and_the_wait_per_relay_core(tmp_path):
    report = _bench("token_path.py", tmp_path / "token_path.json", is_engine_only=False)
    single, batched, waited = report["phases"]
    assert (single["mode"], batched["mode"], waited["mode"]) == ("single", "batched", "batched+wait")
    assert single["events"] == batched["events"] == waited["events"] == report["replies"] * report["tokens_per_reply"] > 0
    for phase in (single, batched, waited):
        assert _is_positive(phase["tokens_per_s"]) and _is_positive(phase["tokens_per_relay_cpu_s"]), phase
    assert report["per_core_ratio"] == pytest.approx(batched["tokens_per_relay_cpu_s"] / single["tokens_per_relay_cpu_s"], rel=0.01)
    # The WAIT phase ran the product path: the primary ran WAITs after the relay's appends, and none
    # without it (counted when the last event is logged: the last batches' WAITs may still be running).
    assert single["redis_waits"] == batched["redis_waits"] == 0
    assert 1 <= waited["redis_waits"] <= report["tokens_per_reply"] * report["replies"]
    cost = report["wait_cost"]
    assert cost["replicas"] == 1 and cost["appends"] > 0
    assert cost["per_core_ratio"] == pytest.approx(waited["tokens_per_relay_cpu_s"] / batched["tokens_per_relay_cpu_s"], rel=0.01)
    assert cost["tokens_per_s_ratio"] == pytest.approx(waited["tokens_per_s"] / batched["tokens_per_s"], rel=0.01)
    assert _is_positive(cost["append_ms_p50"]) and _is_positive(cost["append_wait_ms_p50"])
    assert cost["extra_ms_per_append_p50"] == pytest.approx(cost["append_wait_ms_p50"] - cost["append_ms_p50"], abs=0.002)
    assert set(cost["meaning"]) == set(cost) - {"meaning"}
