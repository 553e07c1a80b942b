"""benchmarks/bench_vllm.py without vLLM servers: reading the client's result, ratios, table, exit status."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks import bench_vllm

from tests.helpers import wait_until

# Shaped like what `vllm bench serve --save-result --percentile-metrics ttft,tpot,itl --metric-percentiles 99` writes.
SAVED = {"duration": 10.0, "completed": 15, "failed": 1, "total_input_tokens": 2048, "total_output_tokens": 480,
         "request_throughput": 1.5, "output_throughput": 48.0, "mean_ttft_ms": 300.0, "median_ttft_ms": 250.0,
         "p99_ttft_ms": 900.0, "mean_tpot_ms": 40.0, "p99_tpot_ms": 60.0, "mean_itl_ms": 40.0, "median_itl_ms": 35.0,
         "p99_itl_ms": 120.0,
         "errors": ["", "HTTP 500: boom", ""]}


def measured(rps: float, ttft: float, itl: float, idle: float) -> dict:
    return {"request_throughput": rps, "ttft_mean_ms": ttft, "ttft_p99_ms": ttft, "tpot_mean_ms": 1.0,
            "tpot_p99_ms": 1.0, "itl_p50_ms": itl / 2, "itl_p99_ms": itl, "failed": 0, "idle_cpu_cores": idle}


def test_client_metrics_read_vllm_bench_serve_keys() -> None:
    metrics = bench_vllm.client_metrics(SAVED)
    assert (metrics["request_throughput"], metrics["ttft_mean_ms"], metrics["ttft_p99_ms"]) == (1.5, 300.0, 900.0)
    assert (metrics["tpot_mean_ms"], metrics["tpot_p99_ms"]) == (40.0, 60.0)
    assert (metrics["itl_p50_ms"], metrics["itl_p99_ms"]) == (35.0, 120.0)
    assert (metrics["completed"], metrics["failed"], metrics["first_error"]) == (15, 1, "HTTP 500: boom")


def test_a_result_without_a_key_is_a_client_error() -> None:
    with pytest.raises(bench_vllm.ClientError, match="p99_itl_ms"):
        bench_vllm.client_metrics({k: v for k, v in SAVED.items() if k != "p99_itl_ms"})


def test_ratios_are_neuron_over_the_baselines_and_null_without_nixl() -> None:
    systems = {"vllm_colocated": measured(2.0, 100.0, 50.0, 0.01), "vllm_nixl": {"skipped": bench_vllm.NO_NIXL},
               "vllm_neuron": measured(3.0, 200.0, 25.0, 0.02), "neuron_di": measured(4.0, 50.0, 10.0, 0.0)}
    assert bench_vllm.ratios(systems) == {
        "neuron_over_nixl_rps": None, "neuron_over_nixl_ttft_mean": None, "neuron_over_colocated_rps": 1.5,
        "neuron_over_colocated_itl_p99": 0.5, "neuron_over_colocated_ttft_mean": 2.0, "neuron_idle_cpu_cores": 0.02,
        "nixl_idle_cpu_cores": None}
    systems["vllm_nixl"] = measured(1.5, 400.0, 30.0, 0.9)
    got = bench_vllm.ratios(systems)
    assert (got["neuron_over_nixl_rps"], got["neuron_over_nixl_ttft_mean"], got["nixl_idle_cpu_cores"]) == (2.0, 0.5, 0.9)


def test_table_shows_skipped_systems_with_their_reason() -> None:
    systems = {"vllm_nixl": {"skipped": bench_vllm.NO_NIXL}, "neuron_di": measured(4.0, 50.0, 10.0, 0.004)}
    table = bench_vllm.format_table(systems, bench_vllm.ratios(systems))
    assert f"vllm_nixl        skipped: {bench_vllm.NO_NIXL}" in table
    assert "4.000" in table and "0.004" in table
    assert "neuron_over_nixl_rps             null" in table


def test_short_reason_keeps_the_first_line_and_the_last_error() -> None:
    text = "the prefill exited with status 1:\nloading\nValueError: one\nmore\nRuntimeError: two\n"
    assert bench_vllm.short_reason(text) == "the prefill exited with status 1: RuntimeError: two"
    assert bench_vllm.short_reason("") == "unknown error"


def test_exit_status() -> None:
    ok = measured(1.0, 1.0, 1.0, 0.0)
    assert bench_vllm.exit_status({"a": ok, "vllm_nixl": {"skipped": bench_vllm.NO_NIXL}}) == 0
    assert bench_vllm.exit_status({"a": ok, "vllm_nixl": {"skipped": "NixlConnector failed"}}) == 1
    assert bench_vllm.exit_status({"a": {**ok, "failed": 2}}) == 3


def test_tree_cpu_seconds_counts_children() -> None:
    pytest.importorskip("psutil")
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(60)"])
    try:
        wait_until(lambda: bench_vllm.tree_cpu_seconds([child.pid]) >= 0.3, timeout=30, what="the child's CPU")
        # Our tree less our own threads: the child's 0.3 s (and any reaped child's), found by descent. /proc counts
        # both processes' time in whole clock ticks, so up to a few hundredths of a second can go missing.
        assert bench_vllm.tree_cpu_seconds([os.getpid()]) - time.process_time() >= 0.25
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("argv, message", [(["--systems", "vllm_bogus"], "unknown ['vllm_bogus']"),
                                           (["--cores", "0,0"], "two different usable cores"),
                                           (["--input-len", "2000", "--output-len", "100"], "exceeds --max-model-len")])
def test_bad_command_line_exits_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_vllm.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
