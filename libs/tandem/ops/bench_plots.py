"""PNG plots of a `tandem bench serve` run (matplotlib's Agg backend: no display needed): the TTFT
and ITL distributions and output throughput over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tandem.ops.bench_client import RequestResult
from tandem.ops.bench_report import throughput_over_time


def _histogram(values_ms: list[float], title: str, path: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.hist(values_ms, bins=min(50, max(5, len(values_ms) // 4)), color="#3b6ea8")
    axes.set_title(title)
    axes.set_xlabel("milliseconds")
    axes.set_ylabel("count")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_plots(results: list[RequestResult], directory: Path, title: str) -> list[Path]:
    """ttft.png, itl.png and throughput.png in `directory` (made if missing); a plot with no data
    (every request failed) is skipped."""
    directory.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.ok]
    written = []
    ttfts_ms = [1000 * r.ttft_s for r in ok if r.ttft_s is not None]
    if ttfts_ms:
        _histogram(ttfts_ms, f"Time to first token ({title})", directory / "ttft.png")
        written.append(directory / "ttft.png")
    itls_ms = [1000 * itl for r in ok for itl in r.itls_s]
    if itls_ms:
        _histogram(itls_ms, f"Inter-token latency ({title})", directory / "itl.png")
        written.append(directory / "itl.png")
    series = throughput_over_time(results)
    if series:
        figure, axes = plt.subplots(figsize=(7, 4))
        times_s = [t for t, _ in series] + [series[-1][0] + 1.0]  # the last bin drawn to its end
        axes.step(times_s, [v for _, v in series] + [series[-1][1]], where="post", color="#3b6ea8")
        axes.set_title(f"Output throughput ({title})")
        axes.set_xlabel("seconds from start")
        axes.set_ylabel("output tokens/s")
        figure.tight_layout()
        figure.savefig(directory / "throughput.png", dpi=100)
        plt.close(figure)
        written.append(directory / "throughput.png")
    return written
