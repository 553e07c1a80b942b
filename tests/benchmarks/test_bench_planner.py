"""The phase-change benchmark: its trace and SLO scoring (pure), and (with --full) a compact run end to end
(two simulated workers, seconds per phase) writing the JSON the summary is read from."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.phase_change import CUT, PHASES, attainment_by_phase, met, recovery_s, request_rows, trace
from benchmarks.serving_metrics import RequestResult
from tests.helpers import ROOT


def result(ttft: float, gaps: list[float], error: str | None = None) -> RequestResult:
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestResult(10, len(times), start=0.0, chunk_times=times, end=times[-1], output_tokens=len(times),
                         error=error)


def test_the_trace_changes_shape_phase_by_phase() -> None:
    arrivals = trace(PHASES, 60.0, 12, seed=1)
    by_phase = [[a for a in arrivals if a.phase == i] for i in range(len(PHASES))]
    assert all(i * 60 <= a.offset_s < (i + 1) * 60 for i, phase in enumerate(by_phase) for a in phase)
    mean_prompt = [sum(len(a.request.prompt_token_ids) for a in p) / len(p) for p in by_phase]
    mean_output = [sum(a.request.output_len for a in p) / len(p) for p in by_phase]
    assert mean_prompt[1] > 5 * max(mean_prompt[0], mean_prompt[2])    # documents: prefill heavy
    assert mean_output[2] > 3 * max(mean_output[0], mean_output[1])    # generations: decode heavy
    assert len(by_phase[4]) < len(by_phase[3]) / 3                     # quiet
    assert trace(PHASES, 60.0, 12, seed=1) == arrivals


def test_a_request_meets_the_slo_by_ttft_and_tpot() -> None:
    assert met(result(1.0, [0.1] * 9))
    assert not met(result(3.5, [0.1] * 9))
    assert not met(result(1.0, [0.4] * 9))
    assert not met(result(1.0, [0.1], error="HTTP 503: draining"))
    assert met(result(1.0, [0.1, 0.2], error=CUT)) and not met(result(1.0, [0.5], error=CUT))


def test_attainment_and_recovery_per_phase() -> None:
    arrivals = trace(PHASES[:2], 20.0, 12, seed=2)
    results = [result(5.0 if a.phase == 1 and a.offset_s < 30 else 1.0, [0.1]) for a in arrivals]
    shares = attainment_by_phase(arrivals, results, 2, seconds=20.0)
    assert shares[0] == 1.0 and 0.2 < shares[1] < 0.8
    assert recovery_s(arrivals, results, 0, 20.0) == 0.0 and recovery_s(arrivals, results, 1, 20.0) == 10.0
    rows = request_rows(arrivals, results)
    late = next(i for i, a in enumerate(arrivals) if a.phase == 1)
    assert rows[late] == [round(arrivals[late].offset_s, 2), 1, len(arrivals[late].request.prompt_token_ids), 5.0,
                          0.1, False, None]
    assert [row[5] for row in rows] == [met(r) for r in results]


@pytest.mark.slow
def test_a_compact_run_writes_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "planner.json"
    done = compact_run("--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = report["summary"]
    for key in ("planner_min_phase_attainment", "best_static_min_phase_attainment", "planner_max_changes_per_phase"):
        assert key in summary, key
    assert len(report["planner"]["attainment_by_phase"]) == len(PHASES)
    assert [s["prefill"] for s in report["static"]] == [1]
    assert report["planner"]["timeline"], "the planner recorded its decisions"
    assert "planner" in done.stdout and "static 1P1D" in done.stdout
    assert report["run"]["command"].endswith(f"--json {out}")
    assert report["planner"]["failed"] == sum(report["planner"]["errors"].values())
    assert len(report["planner"]["per_request"]) == report["planner"]["requests"]
    again = tmp_path / "planner_again.json"
    done = compact_run("--statics-from", str(out), "--json", str(again))   # the planner alone, against those splits
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "static 1P1D:" not in done.stdout   # no static run: its line is not printed (the table has its row)
    rerun = json.loads(again.read_text())
    assert [s["attainment_by_phase"] for s in rerun["static"]] == [s["attainment_by_phase"] for s in report["static"]]
    assert rerun["static"][0]["run"]["command"] == report["run"]["command"] and rerun["planner"]["timeline"]
    refused = compact_run("--statics-from", str(out), "--seed", "5")
    assert refused.returncode != 0
    assert "ran another trace: workers 2 (here 2), static_phase_seconds 2.0 (here 2.0), seed 0 (here 5)" in refused.stderr


def compact_run(*flags: str) -> subprocess.CompletedProcess:
    """Two simulated workers, one static split, seconds per phase."""
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_planner", "--workers", "2", "--static-splits", "1",
         "--phase-seconds", "4", "--static-phase-seconds", "2", "--grace-seconds", "2", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
