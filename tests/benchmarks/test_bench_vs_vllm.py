"""benchmarks/bench_vs_vllm.py: its command line, ratios, worst and goals from canned client results, our
single-worker starter for real, and (slow) one real --quick run against `vllm serve`."""
from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from benchmarks import bench_vs_vllm
from stack.serving import StackOptions, start_both
from stack.vllm import VllmOptions, serve_args
from benchmarks.vllm_bench_client import client_metrics

from tests.script_runs import run_script
from tests.benchmarks.tiny_model import tiny_model_dir


def saved_result(rps: float = 1.0, ttft: float = 100.0, itl_p99: float = 40.0, failed: int = 0) -> dict:
    """A result shaped like what `vllm bench serve --save-result` writes (without --save-detailed)."""
    return {"duration": 10.0, "completed": 16 - failed, "failed": failed, "total_input_tokens": 2048,
            "total_output_tokens": 512, "request_throughput": rps, "output_throughput": 51.2,
            "mean_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": 20.0,
            "p99_tpot_ms": 30.0, "median_itl_ms": itl_p99 / 2, "p99_itl_ms": itl_p99}


def saved(rps: float, ttft: float, itl_p99: float, failed: int = 0) -> dict:
    """Our metrics from such a result."""
    return client_metrics(saved_result(rps, ttft, itl_p99, failed))


RESULTS = {"builtin_128_64": {"ours": saved(3.0, 40.0, 30.0), "vllm": saved(2.0, 80.0, 40.0)},
           "bench24m_512_128": {"ours": saved(1.1, 300.0, 60.0), "vllm": saved(1.0, 250.0, 50.0)}}


def test_defaults_and_quick() -> None:
    args = bench_vs_vllm.parse_args([])
    assert (args.workloads, args.core, args.num_prompts, args.num_warmups) == (list(bench_vs_vllm.WORKLOADS), 0, 64, 8)
    quick = bench_vs_vllm.parse_args(["--quick", "--workloads", "bench24m_2000_64", "--num-prompts", "5"])
    assert (quick.workloads, quick.num_prompts, quick.num_warmups) == (["bench24m_2000_64"], 5, 2)
    assert bench_vs_vllm.lengths(bench_vs_vllm.WORKLOADS["bench24m_2000_64"], quick=True) == (2000, 32)
    assert bench_vs_vllm.lengths(bench_vs_vllm.WORKLOADS["bench24m_2000_64"], quick=False) == (2000, 64)


def test_both_servers_compute_in_the_dtype_asked() -> None:
    workload = bench_vs_vllm.WORKLOADS["builtin_128_64"]
    assert bench_vs_vllm.parse_args([]).dtype == "float32"
    args = bench_vs_vllm.parse_args(["--dtype", "bfloat16", "--ours-extra", "--seed 3"])
    flags = bench_vs_vllm.ours_flags(workload, args)
    assert flags[-4:] == ["--dtype", "bfloat16", "--seed", "3"]
    vllm_args = serve_args(VllmOptions(model="m", dtype=args.dtype), 8000)
    assert vllm_args[vllm_args.index("--dtype") + 1] == "bfloat16"


def test_systems_choose_which_servers_start() -> None:
    workload = bench_vs_vllm.WORKLOADS["builtin_128_64"]
    assert list(bench_vs_vllm.starters(workload, "m", bench_vs_vllm.parse_args([]))) == ["ours", "vllm"]
    alone = bench_vs_vllm.parse_args(["--systems", "ours"])
    assert list(bench_vs_vllm.starters(workload, "m", alone)) == ["ours"]


def test_ours_extra_flags_are_split_and_kept_in_order() -> None:
    args = bench_vs_vllm.parse_args(["--ours-extra", "--max-num-seqs 8", "--ours-extra=--seed=3"])
    assert args.ours_extra == ["--max-num-seqs", "8", "--seed=3"]


@pytest.mark.parametrize("argv, message", [(["--workloads", "builtin_128_64,bogus"], "unknown ['bogus']"),
                                           (["--core", "4096"], "4096 is not usable"),
                                           (["--num-prompts", "0"], "at least 1"),
                                           (["--ours-extra", "'unclosed"], "--ours-extra: No closing quotation"),
                                           (["--systems", "ours,sglang"], "--systems: a comma-separated subset")])
def test_bad_command_line_exits_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_vs_vllm.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_every_workload_fits_both_servers_with_kv_for_every_request() -> None:
    for workload in bench_vs_vllm.WORKLOADS.values():
        assert workload.input_len + workload.output_len <= workload.max_model_len
    long = bench_vs_vllm.WORKLOADS["bench24m_2000_64"]
    assert bench_vs_vllm.kv_blocks(long, 8, 16) == 8 * 132
    assert bench_vs_vllm.kv_blocks(long, 8, 128) == 8 * 17
    assert bench_vs_vllm.kv_blocks(long, 8, 128) * 128 >= 8 * long.max_model_len


def test_ratios_worst_and_goals() -> None:
    ratios = bench_vs_vllm.all_ratios(RESULTS)
    assert ratios["builtin_128_64"] == {"throughput_vs_vllm": 1.5, "ttft_mean_vs_vllm": 0.5, "itl_p99_vs_vllm": 0.75}
    assert ratios["bench24m_512_128"] == pytest.approx(
        {"throughput_vs_vllm": 1.1, "ttft_mean_vs_vllm": 1.2, "itl_p99_vs_vllm": 1.2})
    # Worst: the lowest throughput ratio, the highest latency ratios.
    assert ratios["worst"] == pytest.approx({"throughput_vs_vllm": 1.1, "ttft_mean_vs_vllm": 1.2, "itl_p99_vs_vllm": 1.2})
    assert bench_vs_vllm.goals(ratios["worst"]) == {"throughput_vs_vllm": False, "ttft_mean_vs_vllm": False,
                                                    "itl_p99_vs_vllm": False}
    assert bench_vs_vllm.goals(ratios["builtin_128_64"]) == {"throughput_vs_vllm": True, "ttft_mean_vs_vllm": True,
                                                             "itl_p99_vs_vllm": True}
    # On the targets exactly: met.
    assert all(bench_vs_vllm.goals({"throughput_vs_vllm": 1.2, "ttft_mean_vs_vllm": 0.8, "itl_p99_vs_vllm": 1.0}).values())


def test_a_skipped_system_leaves_its_ratios_and_the_worst_unknown() -> None:
    results = {**RESULTS, "bench24m_2000_64": {"ours": saved(1.0, 1.0, 1.0), "vllm": {"skipped": "it exited"}}}
    ratios = bench_vs_vllm.all_ratios(results)
    assert set(ratios["bench24m_2000_64"].values()) == {None}
    assert set(ratios["worst"].values()) == {None}
    assert not any(bench_vs_vllm.goals(ratios["worst"]).values())
    assert bench_vs_vllm.exit_status(results) == 1
    table = bench_vs_vllm.format_table(results, ratios)
    assert "vllm    skipped: it exited" in table
    assert "throughput_vs_vllm   null  (>= 1.2: not met)" in table


def test_exit_status_and_table() -> None:
    assert bench_vs_vllm.exit_status(RESULTS) == 0
    failing = {"builtin_128_64": {"ours": saved(3.0, 40.0, 30.0, failed=2), "vllm": saved(2.0, 80.0, 40.0)}}
    assert bench_vs_vllm.exit_status(failing) == 3
    table = bench_vs_vllm.format_table(RESULTS, bench_vs_vllm.all_ratios(RESULTS))
    assert "ours/vllm: throughput_vs_vllm 1.500, ttft_mean_vs_vllm 0.500, itl_p99_vs_vllm 0.750" in table
    assert "ttft_mean_vs_vllm    1.200  (<= 0.8: not met)" in table
    assert "15.00" in table  # the builtin workload's ours ITL p50


def test_json_report_holds_the_command_line_every_option_and_the_goals() -> None:
    argv = ["--quick", "--workloads", "builtin_128_64,bench24m_512_128", "--ours-extra", "--max-num-seqs 8"]
    out = bench_vs_vllm.report(bench_vs_vllm.parse_args(argv), RESULTS, argv)
    config = out["config"]
    assert config["command"] == ("python -m benchmarks.bench_vs_vllm --quick --workloads builtin_128_64,bench24m_512_128 "
                                 "--ours-extra '--max-num-seqs 8'")
    assert (config["core"], config["num_prompts"], config["ours_extra"]) == (0, 16, ["--max-num-seqs", "8"])
    assert config["workload_specs"]["bench24m_512_128"]["run_lengths"] == (512, 32)
    assert set(out) == {"config", "results", "ratios", "goals"}
    assert out["goals"] == bench_vs_vllm.goals(out["ratios"]["worst"])
    json.dumps(out, allow_nan=False)


def test_start_both_runs_one_worker_with_the_extra_flags(tmp_path: Path) -> None:
    options = StackOptions(cores=(0, None), model=str(tiny_model_dir(tmp_path)), startup_timeout_s=120)
    with start_both(options, ["--max-num-seqs", "3"]) as stack:
        [worker] = stack.processes
        assert worker.args[-2:] == ["--max-num-seqs", "3"] and "--threads" in worker.args
        assert stack.url == stack.worker_urls["worker"]
        body = {"model": httpx.get(f"{stack.url}/v1/models").json()["data"][0]["id"], "prompt": "hi",
                "max_tokens": 4, "ignore_eos": True}
        answer = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 4
    assert worker.proc.poll() is not None


@pytest.mark.slow
def test_quick_run_against_vllm(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/test.sh installs it)")
    out = tmp_path / "vs_vllm.json"
    done = run_script("benchmarks.bench_vs_vllm", "--quick", "--workloads", "builtin_128_64", "--json", str(out), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads(out.read_text())
    systems = report["results"]["builtin_128_64"]
    for system in ("ours", "vllm"):
        assert (systems[system]["completed"], systems[system]["failed"]) == (16, 0), system
        assert systems[system]["total_output_tokens"] == 16 * 32
    assert "--threads 1" in systems["ours"]["server_command"]
    assert systems["vllm"]["server_env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert all(not math.isnan(v) and v > 0 for v in report["ratios"]["worst"].values())
    assert set(report["goals"]) == {"throughput_vs_vllm", "ttft_mean_vs_vllm", "itl_p99_vs_vllm"}


def test_stalls_and_the_largest_gap_come_from_the_per_request_gaps() -> None:
    # Two requests, median ITL 20 ms: the 80 and 300 ms gaps are stalls (> 3 x 20), 50 ms is not.
    itls = [[0.02, 0.02, 0.08, 0.02], [0.02, 0.3, 0.05]]
    result = {**saved_result(), "median_itl_ms": 20.0, "itls": itls}
    metrics = client_metrics(result)
    assert metrics["stalls_per_request"] == 1.0 and metrics["largest_gap_ms"] == pytest.approx(300.0)
    without = client_metrics(saved_result())   # a result saved without --save-detailed
    assert without["stalls_per_request"] is None and without["largest_gap_ms"] is None
    table = bench_vs_vllm.format_table({"builtin_128_64": {"ours": metrics, "vllm": without}},
                                       bench_vs_vllm.all_ratios({"builtin_128_64": {"ours": metrics, "vllm": without}}))
    assert "stalls/req" in table and "max gap" in table and "300.0" in table and "null" in table
