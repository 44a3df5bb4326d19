"""The worksheet as text: a heading with the inputs, sections of aligned lines (quantity, value,
formula), and a footer naming the assumptions and whatever was left out for want of a figure."""

from __future__ import annotations

from tandem.ops.gpus import Gpu
from tandem.ops.model_shape import ModelShape
from tandem.ops.plan_deploy import render_replica_settings, replica_settings
from tandem.ops.plan_inputs import Assumptions, Deployment, Traffic
from tandem.ops.units import fmt_bytes, fmt_count, fmt_flops, fmt_pct, fmt_rate
from tandem.ops.worksheet import Worksheet

# each section starts at the first of its keys on the sheet
SECTIONS = {
    "weight_bytes": "memory, per replica",
    "decode_bytes_per_step": "decode, per replica",
    "prefill_tokens_per_s_per_gpu": "prefill",
    "decode_replicas": "fleet, at peak with headroom",
    "kw_per_server": "power and cost",
    "cost_per_hour": "power and cost",  # when power is unknown
}


def render(model: ModelShape, gpu: Gpu, deployment: Deployment, traffic: Traffic, assumptions: Assumptions, worksheet: Worksheet) -> str:
    out = [
        f"{model.name}: {model.num_layers} layers, {model.num_kv_heads} KV heads, head dim {model.head_dim}, "
        f"{model.num_params:,} params; {deployment.weight_dtype} weights, {deployment.kv_dtype} KV",
        f"on {gpu.name}: {fmt_bytes(gpu.memory_bytes)}, {fmt_bytes(gpu.bandwidth_bytes_per_s)}/s, "
        f"{fmt_flops(gpu.flops_for(deployment.weight_dtype))} dense {deployment.weight_dtype} ({gpu.source}); "
        f"{deployment.gpus_per_replica} GPU(s) per replica, {fmt_count(deployment.context_tokens)}-token context",
    ]
    if traffic.is_given:
        out.append(
            f"traffic at peak: {fmt_rate(traffic.output_tokens_per_s)} output tokens/s, "
            f"{fmt_rate(traffic.prompt_tokens_per_s)} uncached prompt tokens/s"
        )
    label_width = max(len(line.label) for line in worksheet.lines)
    shown_width = max(len(line.shown) for line in worksheet.lines)
    titles: set[str] = set()
    for line in worksheet.lines:
        if line.key in SECTIONS and SECTIONS[line.key] not in titles:
            titles.add(SECTIONS[line.key])
            out += ["", SECTIONS[line.key]]
        out.append(f"  {line.label:<{label_width}}  {line.shown:>{shown_width}}  = {line.formula}")
    out += ["", *render_replica_settings(replica_settings(deployment, assumptions, worksheet), assumptions)]
    out += ["", _assumptions(assumptions, deployment), *_left_out(gpu, traffic, assumptions, worksheet)]
    return "\n".join(out)


def _assumptions(assumptions: Assumptions, deployment: Deployment) -> str:
    return (
        f"assumptions: runtime reserve {fmt_pct(assumptions.runtime_reserve)}, bandwidth efficiency "
        f"{fmt_pct(assumptions.bandwidth_efficiency)}, compute efficiency {fmt_pct(assumptions.compute_efficiency)}, "
        f"headroom {fmt_pct(assumptions.headroom)}, PUE {assumptions.pue:g}, {deployment.gpus_per_server} GPU(s) per server, "
        f"average busyness {fmt_pct(assumptions.average_busyness)}; every sequence holds its whole context; "
        "decode splits weights and KV evenly over a replica's GPUs; prefill counts 2 FLOPs per parameter per token"
    )


def _left_out(gpu: Gpu, traffic: Traffic, assumptions: Assumptions, worksheet: Worksheet) -> list[str]:
    if not traffic.is_given:
        return ["no fleet: give --output-tokens-per-s and --prompt-tokens-per-s (at peak) to size one"]
    notes = []
    if worksheet.power_mw is None:
        notes.append(f"no power: {gpu.name} has no board power here; give --kw-per-server (or --gpu-power-w)")
    if worksheet.cost_per_day is None:
        notes.append(f"no cost: {gpu.name} has no price here; give --gpu-hour-price")
    elif assumptions.gpu_hour_price is None:
        notes.append(f"cost at the table's indicative {gpu.hour_price:g} $/GPU-hour; give --gpu-hour-price with yours")
    return notes
