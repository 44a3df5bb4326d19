"""The stream bench's numbers from its clients' per-stream summaries, and its table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

HELD_TARGET = 10_000
# Descriptors a chat instance may keep after its streams are gone: its Redis pool for short
# commands (redis_max_connections, 64) and its log readers (stream_readers, 4), opened on demand.
FD_ALLOWANCE = 64 + 4 + 8


def stream_counts(
    summaries: list[dict[str, Any]], wanted: dict[str, tuple[int, int]], delays: list[int], bin_ms: int, started_s: float
) -> dict[str, Any]:
    """`wanted[reply]`: (chain, number of events) of its full log; `delays`: a histogram of the
    live events' write-to-delivery delays."""
    answered = [s for s in summaries if s["status"] == 200]
    complete = [
        s for s in answered
        if s["is_done"] and s["is_contiguous"] and (s["chain"], s["num_events"]) == wanted[s["reply_id"]]
    ]  # fmt: skip
    arrivals = [s for s in answered if s["num_events"]]
    first_s = min((s["first_arrival_s"] for s in arrivals), default=started_s)
    last_s = max((s["last_arrival_s"] for s in arrivals), default=started_s)
    num_events = sum(s["num_events"] for s in answered)
    return {
        "statuses": dict(Counter(str(s["status"]) for s in summaries)),
        "streams_answered_200": len(answered),
        "streams_complete": len(complete),
        "streams_resumed": sum(1 for s in summaries if s["num_resumes"]),
        "num_resumes": sum(s["num_resumes"] for s in summaries),
        "events_delivered": num_events,
        "events_per_s": num_events / (last_s - first_s) if last_s > first_s else 0.0,
        "all_first_events_s": max((s["first_arrival_s"] for s in arrivals), default=started_s) - started_s,
        "live_events_timed": sum(delays),
        "delay_p50_ms": percentile_of(delays, bin_ms, 50),
        "delay_p99_ms": percentile_of(delays, bin_ms, 99),
        "delay_max_ms": percentile_of(delays, bin_ms, 100),
    }


def percentile_of(histogram: list[int], bin_ms: int, q: float) -> float | None:
    """The upper edge of the bin holding the q-th percentile; None for an empty histogram."""
    total = sum(histogram)
    if total == 0:
        return None
    rank = q / 100 * total
    seen = 0
    for index, count in enumerate(histogram):
        seen += count
        if count and seen >= rank:
            return float((index + 1) * bin_ms)
    return float(len(histogram) * bin_ms)


def capacity_counts(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    classes = Counter(str(s["status"]) if s["status"] in (200, 429, 500, 503) else "other" for s in summaries)
    return {
        "requested": len(summaries),
        "answers": {name: classes.get(name, 0) for name in ("200", "503", "429", "500", "other")},
        "with_retry_after": {str(code): sum(1 for s in summaries if s["status"] == code and s["has_retry_after"]) for code in (503, 429)},
        "error_codes": dict(Counter(s["error_code"] for s in summaries if s["error_code"])),
        "ended_by_server_200s": sum(1 for s in summaries if s["status"] == 200 and s["num_server_ends"]),
        "done_200s": sum(1 for s in summaries if s["status"] == 200 and s["is_done"]),
    }


def print_table(result: dict[str, Any], delay_target_ms: float, mark: Callable[[bool], str]) -> None:
    peak, base, after = result["chat_peak"], result["chat_baseline"], result["chat_after"]
    requested = result["streams_requested"]
    p99 = result["delay_p99_ms"]

    def row(name: str, value: str, target: str = "", is_met: bool | None = None) -> None:
        print(f"  {name:<44}{value:>16}   {target:<26}{'' if is_met is None else mark(is_met)}")

    print(f"\ntandem streams, {requested} on one chat instance over {result['replies']} replies, {result['clients']} client processes")
    if "chat_cpus" in result:
        print(f"  the chat on CPUs {result['chat_cpus']}, everything else on {result['other_cpus']}")
    row("streams held at once (peak)", f"{peak['held']}", f">= {HELD_TARGET:,}", peak["held"] >= HELD_TARGET)
    row("streams answered 200", f"{result['streams_answered_200']}/{requested}", "all", result["streams_answered_200"] == requested)
    row("streams with every event of the log", f"{result['streams_complete']}/{requested}", "all", result["streams_complete"] == requested)
    row("streams dropped and resumed (Last-Event-ID)", f"{result['streams_resumed']}")
    row("  attached before their reply's last event", f"{result['streams_attached_while_running']}/{requested}")
    row("write-to-delivery delay p50 (ms)", _ms(result["delay_p50_ms"]))
    row("write-to-delivery delay p99 (ms)", _ms(p99), f"<= {delay_target_ms:.0f}", p99 is not None and p99 <= delay_target_ms)
    row("  live events timed", f"{result['live_events_timed']}")
    if result.get("client_loop_lag_p99_ms") is not None:
        row("  client event loop lag p50 / p99 (ms)", f"{_ms(result['client_loop_lag_p50_ms'])} / {_ms(result['client_loop_lag_p99_ms'])}")
    row("events/s delivered", f"{result['events_per_s']:.0f}")
    row("s until every stream had its first event", f"{result['all_first_events_s']:.1f}")
    answer = result.get("stream_answer_s", {})
    if answer:
        row("  request to answer p50 / p99 / max (s)", f"{answer['p50']:.2f} / {answer['p99']:.2f} / {answer['max']:.2f}")
    row("chat CPU s while streaming (us per event)", f"{result['chat_cpu_s']:.1f} ({result['chat_cpu_us_per_event']:.1f})")
    others = result.get("others_cpu_s", {})
    if others:
        shown = ", ".join(f"{name} {cpu:.0f}" for name, cpu in others.items())
        row(f"CPU s of the others in {result['streaming_s']:.0f} s", shown)
    seen = result.get("chat_metrics", {})
    if seen:
        row("chat event loop lag p50 / p99 (ms)", f"{_ms(seen['loop_lag_p50_ms'])} / {_ms(seen['loop_lag_p99_ms'])}")
        row("chat pass of a reply's events p50 / p99 (ms)", f"{_ms(seen['pass_p50_ms'])} / {_ms(seen['pass_p99_ms'])}")
        row("produced-to-written by the chat p50 / p99 (ms)", f"{_ms(seen['written_p50_ms'])} / {_ms(seen['written_p99_ms'])}")
    full = result.get("chat_gc", {}).get("2", {})
    if full:
        row(
            "chat full GC passes: count / s / longest s",
            f"{full.get('count', 0):.0f} / {full.get('total_s', 0):.1f} / {full.get('longest_s', 0):.2f}",
        )
    row("chat RSS per held stream (KiB)", f"{result['rss_bytes_per_stream'] / 1024:.1f}")
    row("chat RSS MiB: idle / peak / after", f"{base['rss_bytes'] >> 20} / {peak['rss_bytes'] >> 20} / {after['rss_bytes'] >> 20}")
    is_freed = after["fds"] <= base["fds"] + FD_ALLOWANCE
    row("chat fds: idle / peak / after", f"{base['fds']} / {peak['fds']} / {after['fds']}", f"after <= idle + {FD_ALLOWANCE}", is_freed)
    capacity = result.get("capacity_phase")
    if capacity:
        answers = capacity["answers"]
        shown = " ".join(f"{name}:{count}" for name, count in answers.items())
        row(f"2x capacity ({capacity['requested']} at {capacity['capacity']})", shown)
        with_retry = capacity["with_retry_after"]["503"]
        is_clean = answers["500"] == 0 and answers["503"] > 0 and with_retry == answers["503"]
        row("  503s with Retry-After; 500s", f"{with_retry}; {answers['500']}", "all 503s; no 500", is_clean)
        freed = capacity["done_200s"] + capacity["ended_by_server_200s"]  # each freed a slot during the phase
        row(
            "  200s vs capacity (+ streams ended early)",
            f"{answers['200']}",
            f"<= {capacity['capacity']} + {freed}",
            answers["200"] <= capacity["capacity"] + freed,
        )
        held = capacity["capped_chat"].get("streams_open", 0)
        row("  held by the capped chat when all answered", f"{held:.0f}", f"<= {capacity['capacity']}", held <= capacity["capacity"])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
