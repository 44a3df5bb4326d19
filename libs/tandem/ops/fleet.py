"""The fleet for a traffic at peak: decode and prefill replicas (with headroom), servers, facility
power and cost, from the per-replica figures already on the sheet."""

from __future__ import annotations

import math

from tandem.ops.gpus import Gpu
from tandem.ops.plan_inputs import Assumptions, Deployment, Traffic
from tandem.ops.sheet import Sheet
from tandem.ops.units import fmt_count, fmt_money, fmt_pct, fmt_rate


def size_fleet(sheet: Sheet, gpu: Gpu, deployment: Deployment, traffic: Traffic, assumptions: Assumptions) -> None:
    v = sheet.values
    gpus, grow = deployment.gpus_per_replica, 1 + assumptions.headroom
    per_replica = v["tokens_per_s_per_replica"]
    decode_replicas = sheet.add(
        "decode_replicas",
        "decode replicas",
        math.ceil(traffic.output_tokens_per_s * grow / per_replica),
        fmt_count(math.ceil(traffic.output_tokens_per_s * grow / per_replica)),
        f"ceil({fmt_rate(traffic.output_tokens_per_s)} output tokens/s x {grow:g} headroom / {fmt_rate(per_replica)})",
    )
    decode_gpus = sheet.add(
        "decode_gpus", "decode GPUs", decode_replicas * gpus, fmt_count(decode_replicas * gpus), f"{fmt_count(decode_replicas)} x {gpus}"
    )
    prefill_per_replica = v["prefill_tokens_per_s_per_gpu"] * gpus
    prefill_replicas = sheet.add(
        "prefill_replicas",
        "prefill replicas",
        math.ceil(traffic.prompt_tokens_per_s * grow / prefill_per_replica),
        fmt_count(math.ceil(traffic.prompt_tokens_per_s * grow / prefill_per_replica)),
        f"ceil({fmt_rate(traffic.prompt_tokens_per_s)} prompt tokens/s x {grow:g} headroom / "
        f"({fmt_rate(v['prefill_tokens_per_s_per_gpu'])} x {gpus} GPUs))",
    )
    prefill_gpus = sheet.add(
        "prefill_gpus",
        "prefill GPUs",
        prefill_replicas * gpus,
        fmt_count(prefill_replicas * gpus),
        f"{fmt_count(prefill_replicas)} x {gpus}",
    )
    total = sheet.add(
        "total_gpus",
        "GPUs",
        decode_gpus + prefill_gpus,
        fmt_count(decode_gpus + prefill_gpus),
        f"{fmt_count(decode_gpus)} + {fmt_count(prefill_gpus)}",
    )
    per_server = deployment.gpus_per_server
    servers = sheet.add(
        "servers",
        "servers",
        math.ceil(total / per_server),
        fmt_count(math.ceil(total / per_server)),
        f"ceil({fmt_count(total)} / {per_server})",
    )
    capacity = sheet.add(
        "fleet_output_tokens_per_s",
        "fleet output at full use",
        decode_replicas * sheet.values["tokens_per_s_per_replica"],
        f"{fmt_rate(decode_replicas * sheet.values['tokens_per_s_per_replica'])} tokens/s",
        f"{fmt_count(decode_replicas)} decode replicas x {fmt_rate(sheet.values['tokens_per_s_per_replica'])}",
    )
    _power(sheet, gpu, deployment, assumptions, servers)
    _cost(sheet, gpu, assumptions, total, capacity)


def _power(sheet: Sheet, gpu: Gpu, deployment: Deployment, assumptions: Assumptions, servers: int) -> None:
    kw = assumptions.kw_per_server
    if kw is None:
        if gpu.board_power_w is None:
            return  # unknown: the values stay None and the worksheet says which flag gives them
        kw = deployment.gpus_per_server * gpu.board_power_w * assumptions.server_power_factor / 1e3
        formula = f"{deployment.gpus_per_server} x {gpu.board_power_w:g} W x {assumptions.server_power_factor:g} server overhead"
    else:
        formula = "--kw-per-server"
    sheet.add("kw_per_server", "power per server", kw, f"{kw:,.2f} kW", formula)
    sheet.add(
        "power_mw",
        "facility power",
        servers * kw * assumptions.pue / 1e3,
        f"{servers * kw * assumptions.pue / 1e3:,.3f} MW",
        f"{fmt_count(servers)} servers x {kw:,.2f} kW x {assumptions.pue:g} PUE",
    )


def _cost(sheet: Sheet, gpu: Gpu, assumptions: Assumptions, total_gpus: int, capacity: float) -> None:
    price = assumptions.gpu_hour_price if assumptions.gpu_hour_price is not None else gpu.hour_price
    if price is None:
        return
    source = "" if assumptions.gpu_hour_price is not None else " (indicative)"
    hourly = sheet.add(
        "cost_per_hour",
        "cost per hour",
        total_gpus * price,
        fmt_money(total_gpus * price),
        f"{fmt_count(total_gpus)} GPUs x {fmt_money(price)}{source}",
    )
    sheet.add("cost_per_day", "cost per day", hourly * 24, fmt_money(hourly * 24), f"{fmt_money(hourly)} x 24")
    if capacity <= 0:
        return
    full = sheet.add(
        "cost_per_million_output_tokens_full_use",
        "per million output tokens, full use",
        hourly / (capacity * 3600) * 1e6,
        fmt_money(hourly / (capacity * 3600) * 1e6),
        f"{fmt_money(hourly)} / ({fmt_rate(capacity)} tokens/s x 3600 s) x 1e6",
    )
    sheet.add(
        "cost_per_million_output_tokens_average",
        "per million output tokens, average",
        full / assumptions.average_busyness,
        fmt_money(full / assumptions.average_busyness),
        f"{fmt_money(full)} / {fmt_pct(assumptions.average_busyness)} average busyness",
    )
