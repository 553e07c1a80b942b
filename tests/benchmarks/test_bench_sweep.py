"""benchmarks/bench_sweep.py: its rules, command line and report without servers; one real quick sweep (slow)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_sweep
from benchmarks.serving_load import make_requests
from benchmarks.serving_metrics import SLO, RequestResult
from benchmarks.serving_report import NO_MATPLOTLIB, SWEEP_COLUMNS, format_sweep_summary, format_sweep_system, plot_sweep
from benchmarks.sweep_rules import goodput_rps, near_batch, rate_point, should_stop

from stack.serving import StackOptions, start_colocated, worker_args
from tests.script_runs import run_script

SLO_ARGS = {"ttft_ms": 2000.0, "largest_gap_ms": 100.0, "attainment_for_goodput": 0.9}


def point(rate: float, attained: float, in_flight: float = 1.0, stalls: float | None = 0.0) -> dict[str, Any]:
    return {"rate_rps": rate, "slo_attainment": attained, "mean_in_flight": in_flight, "stalls_per_request": stalls}


def request(start: float, chunks: list[float], error: str | None = None) -> RequestResult:
    return RequestResult(100, len(chunks), start=start, chunk_times=chunks, end=chunks[-1] if chunks else start + 1,
                         output_tokens=len(chunks), error=error)


def test_goodput_is_the_highest_rate_meeting_the_attainment() -> None:
    points = [point(0.5, 1.0), point(1.0, 0.95), point(1.5, 0.8), point(2.0, 0.9), point(3.0, 0.2)]
    assert goodput_rps(points, 0.9) == 2.0   # 1.5 missed, 2.0 (exactly 90%) met
    assert goodput_rps(points, 0.96) == 0.5
    assert goodput_rps([point(0.5, 0.3)], 0.9) == 0.0
    assert goodput_rps([], 0.9) == 0.0


def test_stop_after_two_rates_in_a_row_under_the_floor() -> None:
    assert not should_stop([point(1, 0.4)], 0.5)
    assert not should_stop([point(1, 0.4), point(2, 0.6)], 0.5)
    assert not should_stop([point(1, 0.4), point(2, 0.6), point(3, 0.45)], 0.5)
    assert should_stop([point(1, 0.9), point(2, 0.49), point(3, 0.1)], 0.5)
    assert not should_stop([point(1, 0.9), point(2, 0.5), point(3, 0.1)], 0.5)  # 50% is not under 50%


def test_near_batch_picks_the_rate_with_the_closest_in_flight_count() -> None:
    points = [point(0.5, 1.0, 2.0, 0.0), point(1.0, 1.0, 6.5, 0.25), point(2.0, 0.7, 10.0, 1.5)]
    assert near_batch(points, 8) == {"batch_target": 8, "rate_rps": 1.0, "mean_batch": 6.5,
                                     "stalls_per_request": 0.25}
    assert near_batch(points, 9)["rate_rps"] == 2.0
    # Two engines share the requests in flight: 10 in flight is a batch of about 5 (6.5: 3.25).
    assert near_batch(points, 4.5, engines=2) == {"batch_target": 4.5, "rate_rps": 2.0, "mean_batch": 5.0,
                                                  "stalls_per_request": 1.5}
    assert near_batch([], 8) is None


def test_rate_point_from_timestamps() -> None:
    # TTFT 0.1 s each; gaps of 20 ms, except one of 150 ms in the second request (a stall, a missed SLO).
    results = [request(0.0, [0.1, 0.12, 0.14, 0.16]), request(1.0, [1.1, 1.12, 1.27, 1.29]),
               request(2.0, [], error="HTTP 503: busy")]
    p = rate_point(1.5, results, 4.0, SLO(ttft_ms=2000, itl_ms=100), stall_factor=3.0)
    assert p["rate_rps"] == 1.5 and (p["completed"], p["failed"]) == (2, 1)
    assert p["slo_attainment"] == pytest.approx(1 / 3)
    assert p["stall_threshold_ms"] == pytest.approx(60.0)   # 3 x the 20 ms median
    assert p["stalls_per_request"] == pytest.approx(0.5)
    assert p["largest_gap_ms"]["p50"] == pytest.approx(85.0)  # of 20 and 150 ms
    assert p["mean_in_flight"] == pytest.approx((0.16 + 0.29 + 1.0) / 4.0)
    json.dumps(p, allow_nan=False)


def test_command_line_defaults_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench_sweep.parse_args(["--quick", "--systems", "di_1p1d,colocated", "--ours-extra=--max-num-seqs 8"])
    assert args.rates == [0.25, 0.5, 1.0, 2.0] and args.systems == ["di_1p1d", "colocated"]
    assert args.ours_extra == ["--max-num-seqs", "8"]
    assert [s.num_prompts for s in args.specs] == [6, 6, 10, 20]  # at least 6, else about 10 s of arrivals
    assert {(s.input_len, s.output_len) for s in args.specs} == {((256, 1536), (128, 128))}
    prompts = [make_requests(s)[0].prompt_token_ids for s in args.specs]
    assert len({tuple(p) for p in prompts}) == 4  # each rate its own prompts: no prefix-cache hits across rates
    assert bench_sweep.parse_args(["--quick"]).specs == args.specs  # the same load for every system
    full = bench_sweep.parse_args(["--rates", "1,2.5", "--seconds-per-rate", "20"])
    assert full.systems == list(bench_sweep.SYSTEMS) and [s.num_prompts for s in full.specs] == [20, 50]
    for bad, message in ((["--rates", "1,0.5"], "rising order"), (["--rates", "1,x"], "expected numbers"),
                         (["--rates", "0,1"], "positive"), (["--systems", "di_1p1d,sglang"], "unknown ['sglang']"),
                         (["--ours-extra", "'unclosed"], "quotation"),
                         (["--input-len-max", "2000"], "exceeds --max-model-len"),
                         (["--stop-attainment", "0.95"], "--stop-attainment <= --goodput-attainment")):
        with pytest.raises(SystemExit) as exit_info:
            bench_sweep.parse_args(bad)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_extra_worker_flags_reach_every_role() -> None:
    options = StackOptions(worker_extra=("--max-num-seqs", "8"))
    for role in ("prefill", "decode", "both"):
        assert worker_args(role, 8100, options)[-2:] == ["--max-num-seqs", "8"]


def test_report_ratios_tables_and_plot(tmp_path: Path) -> None:
    argv = ["--quick", "--systems", "di_1p1d,colocated,vllm_nixl"]
    args = bench_sweep.parse_args(argv)
    results = [request(0.0, [0.1, 0.12, 0.14]), request(0.5, [0.7, 0.72, 0.9])]
    slo = SLO(args.slo_ttft_ms, args.slo_gap_ms)
    measured = [rate_point(r, results, 1.0, slo, 3.0) for r in (0.5, 1.0)]
    di_points = [{**p, "slo_attainment": a} for p, a in zip(measured, (1.0, 0.9))]
    colocated = [{**p, "slo_attainment": a} for p, a in zip(measured, (1.0, 0.4))]
    systems = {"di_1p1d": bench_sweep.system_record("di_1p1d", di_points, args, None),
               "colocated": bench_sweep.system_record("colocated", colocated, args, "stopped after 1 req/s"),
               "vllm_nixl": bench_sweep.skipped("nixl is not installed here")}
    out = bench_sweep.report(args, systems, argv)
    assert out["slo"] == SLO_ARGS
    assert out["ratios"] == {"di_over_vllm_colocated": None, "di_over_vllm_nixl": None, "di_over_colocated": 2.0,
                             "vllm_neuron_over_vllm_colocated": None}
    assert out["config"]["command"] == "python -m benchmarks.bench_sweep " + " ".join(argv)
    assert out["config"]["prompts_per_rate"] == [6, 6, 10, 20]
    json.dumps(out, allow_nan=False)
    table = format_sweep_system("di_1p1d", di_points)
    assert table.splitlines()[1].split() == [c[0] for c in SWEEP_COLUMNS]
    assert len(table.splitlines()) == 4
    summary = format_sweep_summary(systems, out["ratios"], bench_sweep.slo_text(out["slo"]))
    assert "largest gap <= 100 ms" in summary and "skipped: nixl is not installed here" in summary
    assert "stopped after 1 req/s" in summary and "di_over_colocated" in summary
    assert "(rate 0.5, batch ~" in summary  # colocated: two engines share what is in flight
    path = tmp_path / "sweep.png"
    assert plot_sweep({n: s["rates"] for n, s in systems.items()}, out["slo"], path) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_system_that_cannot_start_is_skipped_with_the_reason() -> None:
    args = bench_sweep.parse_args(["--quick", "--startup-timeout", "60"])
    options = StackOptions(cores=args.core_pair, model="/nonexistent-model-dir", startup_timeout_s=60)
    record = bench_sweep.run_system("colocated", lambda: start_colocated(options), args)
    assert record["rates"] == [] and record["goodput_rps"] is None
    assert record["skipped"].startswith("StackError: the worker")


@pytest.mark.slow
def test_quick_sweep_of_our_two_stacks(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    done = run_script("benchmarks.bench_sweep", "--quick", "--systems", "di_1p1d,colocated", "--json", str(out),
                      timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {"di_1p1d", "colocated"}
    for system in report["systems"].values():
        assert "skipped" not in system and system["rates"]
        assert [p["rate_rps"] for p in system["rates"]] == [0.25, 0.5, 1.0, 2.0][:len(system["rates"])]
        assert all(p["failed"] == 0 and p["completed"] == p["num_requests"] for p in system["rates"])
        assert all(p["stalls_per_request"] is not None for p in system["rates"])
    assert "goodput/s" in done.stdout
    png = out.with_suffix(".png")
    if NO_MATPLOTLIB not in done.stdout:  # matplotlib is an optional extra
        assert f"wrote {png}" in done.stdout and png.read_bytes()[:4] == b"\x89PNG"
