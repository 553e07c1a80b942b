"""The phase-change benchmark's summary, table and plot."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

from benchmarks.phase_change import MOCK_COSTS, PHASES, TPOT_TARGET_S, TTFT_TARGET_S
from benchmarks.serving_report import NO_MATPLOTLIB, _pyplot, _save

STATIC_PHASES = 4


def _min(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def summarize(args: argparse.Namespace, statics: list[dict[str, Any]], planner: dict[str, Any]) -> dict[str, Any]:
    """Every run, and the summary the goals are read from."""
    best = max(statics, key=lambda s: _min(s["attainment_by_phase"]) or 0.0)
    per_phase = []
    for i in range(STATIC_PHASES):
        top = max(statics, key=lambda s: s["attainment_by_phase"][i] or 0.0)
        per_phase.append({"phase": PHASES[i].name, "split": f"{top['prefill']}P{top['decode']}D",
                          "attainment": top["attainment_by_phase"][i]})
    totals = [d["prefill"] + d["decode"] for d in planner["timeline"]]
    quiet_start = (len(PHASES) - 1) * args.phase_seconds
    quiet_totals = [d["prefill"] + d["decode"] for d in planner["timeline"] if d["t"] >= quiet_start]
    summary = {
        "planner_min_phase_attainment": _min(planner["attainment_by_phase"]),
        "best_static_min_phase_attainment": _min(best["attainment_by_phase"]),
        "best_static_split": f"{best['prefill']}P{best['decode']}D",
        "planner_max_changes_per_phase": max(planner["changes_by_phase"], default=0),
        "planner_max_changes_after_settle_per_phase": max(planner["changes_after_settle_by_phase"], default=0),
        "planner_recovery_s_by_phase": planner["recovery_s_by_phase"],
        "planner_workers_max": max(totals, default=0),
        "planner_workers_at_end": quiet_totals[-1] if quiet_totals else None,
        "planner_scaled_down_when_load_dropped": bool(quiet_totals) and quiet_totals[-1] < max(totals, default=0),
        "best_static_per_phase": per_phase,
    }
    summary["goals"] = {
        "planner_min_phase_attainment_ge_0.9": (summary["planner_min_phase_attainment"] or 0) >= 0.9,
        "best_static_below_0.7_in_a_phase": (summary["best_static_min_phase_attainment"] or 0) < 0.7,
        "at_most_one_change_per_phase_after_settling": summary["planner_max_changes_after_settle_per_phase"] <= 1,
        "scales_down_when_load_drops": summary["planner_scaled_down_when_load_dropped"],
    }
    return {"phases": [p.name for p in PHASES], "workers": args.workers, "phase_seconds": args.phase_seconds,
            "static_phase_seconds": args.static_phase_seconds, "slo": {"ttft_s": TTFT_TARGET_S, "tpot_s": TPOT_TARGET_S},
            "mock_costs": MOCK_COSTS, "summary": summary, "planner": planner, "static": statics}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def format_table(report: dict[str, Any]) -> str:
    phases = report["phases"]
    lines = [f"{'run':<16}" + "".join(f"{p:>13}" for p in phases)]
    planner = report["planner"]
    lines.append(f"{'planner':<16}" + "".join(f"{_pct(v):>13}" for v in planner["attainment_by_phase"]))
    for run in report["static"]:
        name = f"static {run['prefill']}P{run['decode']}D"
        lines.append(f"{name:<16}" + "".join(f"{_pct(v):>13}" for v in run["attainment_by_phase"]))
    lines.append(f"{'changes':<16}" + "".join(f"{v:>13}" for v in planner["changes_by_phase"]))
    lines.append(f"{'after settling':<16}" + "".join(f"{v:>13}" for v in planner["changes_after_settle_by_phase"]))
    lines.append(f"{'recover s':<16}" + "".join(f"{'-' if v is None else f'{v:.0f}':>13}"
                                                for v in planner["recovery_s_by_phase"]))
    lines += [f"{key}: {value}" for key, value in report["summary"].items() if key != "best_static_per_phase"]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> str | None:
    """Attainment over time and the P/D counts of the planner's run, and attainment per phase; or why not."""
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    planner, seconds = report["planner"], report["phase_seconds"]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 10))
    points = [(t, a) for t, a in planner["rolling_attainment"] if a is not None]
    top.plot([t for t, _ in points], [a * 100 for _, a in points], marker=".", label="planner, 5 s windows")
    top.axhline(90, color="gray", linestyle=":")
    top.set_ylabel("SLO attainment %")
    middle.step([d["t"] for d in planner["timeline"]], [d["prefill"] for d in planner["timeline"]], where="post",
                label="prefill workers")
    middle.step([d["t"] for d in planner["timeline"]], [d["decode"] for d in planner["timeline"]], where="post",
                label="decode workers")
    middle.set_ylabel("workers")
    middle.set_xlabel("seconds")
    for axis in (top, middle):
        for i, name in enumerate(report["phases"]):
            axis.axvline(i * seconds, color="gray", linewidth=0.5)
            axis.text(i * seconds + 1, axis.get_ylim()[1] * 0.95, name, fontsize=8, va="top")
        axis.legend(loc="lower right", fontsize=8)
    best = next(s for s in report["static"]
                if f"{s['prefill']}P{s['decode']}D" == report["summary"]["best_static_split"])
    phases = report["phases"][:STATIC_PHASES]
    xs = range(len(phases))
    width = 0.27
    series = [("planner", planner["attainment_by_phase"][:STATIC_PHASES]),
              (f"best static ({report['summary']['best_static_split']})", best["attainment_by_phase"]),
              ("best static per phase", [p["attainment"] for p in report["summary"]["best_static_per_phase"]])]
    for k, (label, values) in enumerate(series):
        bottom.bar([x + (k - 1) * width for x in xs], [(v or 0) * 100 for v in values], width, label=label)
    bottom.set_xticks(list(xs), phases)
    bottom.axhline(90, color="gray", linestyle=":")
    bottom.set_ylabel("SLO attainment %")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    return None
