"""Reporting benchmark runs: a side-by-side table and a PNG of the ITL and TTFT distributions;
for a rate sweep, a table per system, a summary table and a PNG of attainment, ITL and TTFT vs rate."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from benchmarks.serving_metrics import RequestResult

DISTRIBUTIONS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
STATS = ("mean", "p50", "p90", "p99")


def table_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, formatted value) for each number of one summary, in print order."""
    rows = [("completed / failed", f"{summary['completed']} / {summary['failed']}"),
            ("duration (s)", f"{summary['duration_s']:.2f}"),
            ("request throughput (req/s)", f"{summary['request_throughput']:.3f}"),
            ("output throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
            ("goodput (req/s)", f"{summary['goodput']:.3f}")]
    for key, label in DISTRIBUTIONS:
        for stat in STATS:
            value = summary[key][stat]
            rows.append((f"{label} {stat} (ms)", "-" if value is None else f"{value:.2f}"))
    return rows


def format_table(summaries: Mapping[str, Mapping[str, Any]], ratios: Mapping[str, float | None]) -> str:
    """One column per configuration, then the ratios between them if any."""
    names = list(summaries)
    columns = [dict(table_rows(s)) for s in summaries.values()]
    labels = [label for label, _ in table_rows(next(iter(summaries.values())))]
    width = max(len(label) for label in labels) + 2
    lines = [f"{'':<{width}}" + "".join(f"{name:>14}" for name in names)]
    lines.append("-" * len(lines[0]))
    for label in labels:
        lines.append(f"{label:<{width}}" + "".join(f"{col[label]:>14}" for col in columns))
    for name, value in ratios.items():
        lines.append(f"{name:<{width}}{'-' if value is None else f'{value:.3f}':>14}")
    return "\n".join(lines)


NO_MATPLOTLIB = "matplotlib is not installed (pip install 'neuron-di[bench]'); no plot written"
# Sweep table columns: (header, key in a sweep point, stat or None, format).
SWEEP_COLUMNS = (("rate/s", "rate_rps", None, "{:.2f}"), ("done", "completed", None, "{}"),
                 ("fail", "failed", None, "{}"), ("inflight", "mean_in_flight", None, "{:.1f}"),
                 ("attain", "slo_attainment", None, "{:.0%}"), ("ttft50", "ttft_ms", "p50", "{:.0f}"),
                 ("ttft99", "ttft_ms", "p99", "{:.0f}"), ("itl50", "itl_ms", "p50", "{:.1f}"),
                 ("itl99", "itl_ms", "p99", "{:.1f}"), ("tpot99", "tpot_ms", "p99", "{:.1f}"),
                 ("gap50", "largest_gap_ms", "p50", "{:.0f}"), ("gap99", "largest_gap_ms", "p99", "{:.0f}"),
                 ("stall/req", "stalls_per_request", None, "{:.2f}"))


def _pyplot() -> Any:
    """matplotlib.pyplot drawing to files only, or None if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def plot_distributions(runs: Mapping[str, Sequence[RequestResult]], path: Path) -> str | None:
    """Writes CDFs of ITL and TTFT side by side; returns why not if matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, title, pick in ((axes[0], "ITL", _itls_ms), (axes[1], "TTFT", _ttfts_ms)):
        for name, results in runs.items():
            values = sorted(pick(results))
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=name)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path)
    plt.close(fig)
    return None


def _itls_ms(results: Sequence[RequestResult]) -> list[float]:
    return [gap * 1e3 for r in results if r.ok for gap in r.itls]


def _ttfts_ms(results: Sequence[RequestResult]) -> list[float]:
    return [r.ttft * 1e3 for r in results if r.ok]


def format_sweep_system(name: str, points: Sequence[Mapping[str, Any]]) -> str:
    """One system's sweep: a row per rate, times in ms."""
    lines = [name, "  ".join(f"{header:>9}" for header, *_ in SWEEP_COLUMNS)]
    for point in points:
        cells = []
        for _, key, stat, fmt in SWEEP_COLUMNS:
            value = point[key] if stat is None else point[key][stat]
            cells.append(f"{'-' if value is None else fmt.format(value):>9}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def format_sweep_summary(systems: Mapping[str, Mapping[str, Any]], ratios: Mapping[str, float | None],
                         slo_text: str) -> str:
    """Goodput and stalls near the target batch per system, then the goodput ratios."""
    lines = [f"SLO: {slo_text}", f"{'system':<16}{'goodput/s':>10}  {'stalls/req near batch':<34}note"]
    for name, system in systems.items():
        goodput = system.get("goodput_rps")
        near = system.get("near_batch")
        near_text = "-" if not near or near["stalls_per_request"] is None else (
            f"{near['stalls_per_request']:.2f} (rate {near['rate_rps']:g}, batch ~{near['mean_batch']:.1f})")
        note = f"skipped: {system['skipped']}" if system.get("skipped") else system.get("stopped_early") or ""
        lines.append(f"{name:<16}{'-' if goodput is None else f'{goodput:g}':>10}  {near_text:<34}{note}")
    for name, value in ratios.items():
        lines.append(f"{name:<34}{'-' if value is None else f'{value:.2f}':>10}")
    return "\n".join(lines)


def plot_sweep(systems: Mapping[str, Sequence[Mapping[str, Any]]], slo: Mapping[str, float], path: Path) -> str | None:
    """Attainment, ITL p99 and TTFT p99 against the offered rate, one line per system, the SLO dashed;
    returns why not if matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    panels = (("SLO attainment", lambda p: p["slo_attainment"] * 100, slo["attainment_for_goodput"] * 100, False,
               "% of requests", "goodput threshold"),
              ("ITL p99", lambda p: p["itl_ms"]["p99"], slo["largest_gap_ms"], True, "ms", "largest-gap SLO"),
              ("TTFT p99", lambda p: p["ttft_ms"]["p99"], slo["ttft_ms"], True, "ms", "TTFT SLO"))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, (title, pick, line, log, unit, what) in zip(axes, panels):
        for name, points in systems.items():
            pairs = [(p["rate_rps"], pick(p)) for p in points if p["completed"]]
            if pairs:
                ax.plot(*zip(*pairs), marker="o", label=name)
        ax.axhline(line, color="grey", linestyle="--", label=f"{what} {line:g}")
        if log:
            ax.set_yscale("log")
        ax.set_title(f"{title} vs offered rate")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    _save(fig, path)
    plt.close(fig)
    return None
