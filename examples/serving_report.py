"""Reporting a benchmark run: a side-by-side table and a PNG of the ITL and TTFT distributions."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from serving_metrics import RequestResult

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


def plot_distributions(runs: Mapping[str, Sequence[RequestResult]], path: Path) -> str | None:
    """Writes CDFs of ITL and TTFT side by side; returns why not if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install 'neuron-di[bench]'); no plot written"
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _itls_ms(results: Sequence[RequestResult]) -> list[float]:
    return [gap * 1e3 for r in results if r.ok for gap in r.itls]


def _ttfts_ms(results: Sequence[RequestResult]) -> list[float]:
    return [r.ttft * 1e3 for r in results if r.ok]
