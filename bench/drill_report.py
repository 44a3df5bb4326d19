"""A drill's report: what its replies did, against its target, and the table the drills print."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DrillReport:
    name: str
    fault: str
    num_replies: int
    fault_unix_s: float = 0.0  # when the fault was caused (wall clock)
    longest_pause_ended_unix_s: float = 0.0
    longest_ttft_s: float = 0.0  # a reply lost before its first token waits here, not in a pause
    completed: int = 0
    errors: int = 0
    hung: int = 0
    refused: int = 0
    longest_pause_s: float = 0.0
    # partitions: when the partition healed (wall clock), and the longest a reply still streaming
    # then waited after it for its next event; None for a drill that heals nothing
    healed_unix_s: float = 0.0
    pause_after_heal_s: float | None = None
    # the longest pause in the undisturbed run of the same prompts (same stack, same run): what
    # the load alone costs on this machine; None when the drill had no undisturbed run
    undisturbed_longest_pause_s: float | None = None
    texts_identical: int | None = None  # of the completed greedy replies, how many match the undisturbed run
    texts_differing: list[int] = field(default_factory=list)  # prompt indices of completed replies that do not
    texts_without_baseline: list[int] = field(default_factory=list)  # completed here, not in the undisturbed run
    ids_contiguous: bool = True
    stored: dict[str, int] = field(default_factory=dict)  # stored assistant turn statuses
    target: str = ""
    met: bool = False
    seconds: float = 0.0
    error_samples: list[str] = field(default_factory=list)
    # The reconnect storm's (bench/drill_storm.py; None for the other drills): its streams over
    # `replies` replies, those that resumed on the other instance after the fault, the answers
    # with a 5xx, the streams whose ids or events differ from the log, and how long after the
    # fault the last stream's reconnect was sent. Its completed/errors/hung count streams.
    streams: int | None = None
    replies: int | None = None
    resumed: int | None = None
    num_5xx: int | None = None
    gaps: int | None = None
    reconnected_within_s: float | None = None
    pause_across_fault_s: float | None = None  # the longest from a stream's last event before the fault to its first after


def print_row(report: DrillReport) -> None:
    print(
        f"{report.name}: {report.completed}/{report.num_replies} complete, {report.errors} errors, {report.hung} hung, {report.refused} refused, "
        f"pause {report.longest_pause_s} s{_after_heal(report)}, TTFT max {report.longest_ttft_s} s, identical {report.texts_identical} "
        f"(differing {report.texts_differing}, no baseline {report.texts_without_baseline}), stored {report.stored} "
        f"[{'PASS' if report.met else 'MISS'}: {report.target}]",
        flush=True,
    )
    if report.streams is not None:
        print(
            f"{report.name}: {report.streams} streams of {report.replies} replies, {report.resumed} resumed, "
            f"{report.num_5xx} 5xx, {report.gaps} gaps, last reconnect {report.reconnected_within_s} s after the fault, "
            f"longest pause across it {report.pause_across_fault_s} s",
            flush=True,
        )


def _after_heal(report: DrillReport) -> str:
    return "" if report.pause_after_heal_s is None else f" ({report.pause_after_heal_s} s after the heal)"


def print_table(reports: list[DrillReport]) -> None:
    header = f"{'drill':<22}{'replies':>8}{'done':>6}{'error':>6}{'hung':>6}{'pause s':>9}{'base s':>8}{'same':>6}  stored / target"
    print("\n" + header)
    for r in reports:
        same = "-" if r.texts_identical is None else str(r.texts_identical)
        base = "-" if r.undisturbed_longest_pause_s is None else str(r.undisturbed_longest_pause_s)
        stored = ",".join(f"{k}:{v}" for k, v in sorted(r.stored.items()))
        print(
            f"{r.name:<22}{r.num_replies:>8}{r.completed:>6}{r.errors:>6}{r.hung:>6}{r.longest_pause_s:>9}{base:>8}{same:>6}  "
            f"{stored} / {'PASS' if r.met else 'MISS'} {r.target}"
        )
        print(f"{'':<22}fault: {r.fault}{_after_heal(r)}")
        if r.error_samples:
            print(f"{'':<22}errors: {'; '.join(r.error_samples)}")
