"""benchmarks/bench_serving.py end to end: against a real worker, the stacks it starts, its report."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from benchmarks import bench_serving
from benchmarks.serving_load import LoadSpec, make_requests, run_load
from benchmarks.serving_metrics import RequestResult
from benchmarks.serving_report import plot_distributions
from stack.serving import Process, Stack, StackError, StackOptions, free_port, start_colocated, start_di, wait_healthy

from tests.benchmarks.tiny_model import tiny_model_dir
from tests.helpers import ROOT, wait_until

BENCH = ("-m", "benchmarks.bench_serving")
SMALL_LOAD = ["--num-prompts", "8", "--input-len-min", "4", "--input-len-max", "24",
              "--output-len-min", "2", "--output-len-max", "6", "--request-rate", "20", "--seed", "3"]
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tiny_model_dir(tmp_path_factory.mktemp("model"))
    port = free_port()
    proc = Process("worker", ["-m", "worker", "--role", "both", "--port", str(port), "--threads", "1",
                              "--model", str(model), "--max-model-len", "256"], env=ENV)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [proc], 120)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **ENV}
    return subprocess.run([sys.executable, *BENCH, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_target_run_reports_every_request(worker_url: str, tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    done = run_bench("--target", worker_url, *SMALL_LOAD, "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "TTFT p99 (ms)" in done.stdout
    report = json.loads(out.read_text())
    assert set(report) == {"config", "target"}
    assert report["config"]["command"].startswith("python -m benchmarks.bench_serving --target")
    run = report["target"]
    assert (run["num_requests"], run["completed"], run["failed"], run["errors"]) == (8, 8, 0, [])
    expected = make_requests(LoadSpec(8, (4, 24), (2, 6), seed=3))
    records = run["requests"]
    assert [r["input_tokens"] for r in records] == [len(r.prompt_token_ids) for r in expected]
    assert [r["output_tokens"] for r in records] == [r.output_len for r in expected]
    assert run["total_output_tokens"] == sum(r.output_len for r in expected)
    assert all(len(r["itl_ms"]) <= r["output_tokens"] - 1 for r in records)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = run[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
        assert d["mean"] > 0
    assert run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
    assert 0 < run["goodput"] <= run["request_throughput"]
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration_s"])


def test_target_run_through_the_di_proxy_with_fake_workers(tmp_path: Path) -> None:
    """The client reads the proxy's stitched DI stream (fake prefill/decode HTTP workers): one chunk per token."""
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    procs = [Process(role, ["-m", "tests.proxy.fake_worker", "--role", role, "--port", str(ports[role])])
                            for role in ("prefill", "decode")]
    try:
        for proc, role in zip(procs, ("prefill", "decode")):
            wait_healthy(f"http://127.0.0.1:{ports[role]}/health", [proc])
        procs.append(Process("proxy", ["proxy_server.py", "--host", "127.0.0.1", "--port", str(ports["proxy"]),
                                       "--prefill-ip", "127.0.0.1", "--prefill-port", str(ports["prefill"]),
                                       "--decode-ip", "127.0.0.1", "--decode-port", str(ports["decode"])]))
        url = f"http://127.0.0.1:{ports['proxy']}"
        wait_healthy(f"{url}/health", [procs[-1]])
        out = tmp_path / "di.json"
        done = run_bench("--target", url, *SMALL_LOAD, "--json", str(out))
        assert done.returncode == 0, done.stderr
    finally:
        for proc in procs:
            proc.stop()
    run = json.loads(out.read_text())["target"]
    expected = make_requests(LoadSpec(8, (4, 24), (2, 6), seed=3))
    assert (run["completed"], run["failed"]) == (8, 0)
    assert [r["output_tokens"] for r in run["requests"]] == [r.output_len for r in expected]
    assert [len(r["itl_ms"]) for r in run["requests"]] == [r.output_len - 1 for r in expected]


def test_rejected_requests_are_counted_as_failures(worker_url: str, tmp_path: Path) -> None:
    out = tmp_path / "failing.json"
    # Prompts longer than the worker's 256-token context: every request gets a 400.
    done = run_bench("--target", worker_url, "--num-prompts", "3", "--input-len-min", "300",
                     "--input-len-max", "300", "--output-len-min", "2", "--output-len-max", "2",
                     "--max-concurrency", "1", "--json", str(out), "--plot", str(tmp_path / "p.png"))
    assert done.returncode == 3, done.stderr
    run = json.loads(out.read_text())["target"]
    assert (run["completed"], run["failed"]) == (0, 3)
    assert len(run["errors"]) == 1 and run["errors"][0].startswith("HTTP 400: ")
    assert run["ttft_ms"]["p50"] is None and run["goodput"] == 0.0


def test_unreachable_target_is_a_clear_error() -> None:
    done = run_bench("--target", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1")
    assert done.returncode == 1
    assert "cannot read the model name" in done.stderr and "Traceback" not in done.stderr


def test_bad_command_line_exits_2() -> None:
    done = run_bench("--compare", "--cores", "0,0")
    assert done.returncode == 2 and "two different usable cores" in done.stderr
    done = run_bench("--target", "http://127.0.0.1:1", "--input-len-min", "9", "--input-len-max", "3")
    assert done.returncode == 2 and "input_len" in done.stderr


def _processes_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue  # exited while we looked
    return pids


# Both workers get the bad model; whichever exits first is named.
@pytest.mark.parametrize("start, who", [(start_di, "(prefill|decode) worker"), (start_colocated, "worker [01]")])
def test_stack_that_cannot_start_fails_fast_and_leaves_nothing(start, who: str) -> None:
    marker = f"/nonexistent-model-{uuid.uuid4().hex}"
    options = StackOptions(cores=(0, 1), model=marker, startup_timeout_s=60)
    with pytest.raises(StackError, match=f"the {who} exited with status"):
        start(options)
    assert _processes_mentioning(marker) == []


def test_a_stack_that_never_gets_healthy_times_out_and_is_stopped() -> None:
    with Stack() as stack:
        silent = stack.start("silent server", ["-c", "import time; print('up, serving nothing', flush=True); time.sleep(60)"])
        wait_until(lambda: "serving nothing" in silent.tail(), what="the silent server's first line")
        with pytest.raises(StackError, match=r"not healthy after 0.5 s\n--- silent server:\nup, serving nothing"):
            wait_healthy(f"http://127.0.0.1:{free_port()}/health", stack.processes, 0.5)
    assert silent.proc.returncode is not None


def test_plot_has_itl_and_ttft(tmp_path: Path) -> None:
    results = [RequestResult(4, 3, start=0.0, chunk_times=[0.01 * i, 0.02 * i, 0.03 * i], end=0.04 * i,
                             output_tokens=3) for i in range(1, 6)]
    path = tmp_path / "cdf.png"
    assert plot_distributions({"di": results, "colocated": results}, path) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _generated_tokens(worker_url: str) -> float:
    text = httpx.get(f"{worker_url}/metrics", timeout=5).text
    return sum(float(m) for m in re.findall(r"^neuron_di_generation_tokens_total(?:{[^}]*})? (\S+)$", text, re.M))


def test_colocated_stack_pins_each_worker_and_serves_through_the_proxy(tmp_path: Path) -> None:
    model = tiny_model_dir(tmp_path)
    with start_colocated(StackOptions(cores=(0, 1), model=str(model))) as stack:
        workers = [p for p in stack.processes if p.name.startswith("worker")]
        for core, process in zip((0, 1), workers):
            threads = os.listdir(f"/proc/{process.proc.pid}/task")
            assert {frozenset(os.sched_getaffinity(int(t))) for t in threads} == {frozenset({core})}
        spec = LoadSpec(6, (4, 12), (3, 3), seed=1)
        results, _ = asyncio.run(run_load(stack.url, model.name, spec, make_requests(spec)))
        assert [(r.error, r.output_tokens) for r in results] == [(None, 3)] * 6
        urls = [f"http://127.0.0.1:{args[args.index('--port') + 1]}" for args in (w.proc.args for w in workers)]
        # Round-robin: each worker generated half of the 18 tokens.
        assert [_generated_tokens(url) for url in urls] == [9.0, 9.0]
    assert all(p.proc.poll() is not None for p in stack.processes)


def test_report_has_both_configs_and_di_over_colocated_ratios() -> None:
    argv = ["--compare", "--num-prompts", "2"]
    args = bench_serving.parse_args(argv)
    fast = [RequestResult(4, 2, start=0.0, chunk_times=[0.1, 0.12], end=0.12, output_tokens=2)] * 2
    slow = [RequestResult(4, 2, start=0.0, chunk_times=[0.2, 0.28], end=0.28, output_tokens=2)] * 2
    out = bench_serving.report(args, {"di": (fast, 1.0), "colocated": (slow, 1.0)}, argv)
    assert {"config", "di", "colocated", "itl_p99_ratio", "ttft_p50_ratio"} <= set(out)
    assert out["ttft_p50_ratio"] == pytest.approx(0.5)
    assert out["itl_p99_ratio"] == pytest.approx(0.25)
    assert out["config"]["command"] == "python -m benchmarks.bench_serving --compare --num-prompts 2"
    assert out["config"]["request_rate"] == 4.0 and out["config"]["num_prompts"] == 2
    json.dumps(out, allow_nan=False)


@pytest.mark.slow
def test_compare_quick_runs_both_stacks(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    done = run_bench("--compare", "--quick", "--model", str(tiny_model_dir(tmp_path)), "--json", str(out),
                     timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert {"config", "di", "colocated", "itl_p99_ratio", "ttft_p50_ratio"} <= set(report)
    for name in ("di", "colocated"):
        assert (report[name]["completed"], report[name]["failed"]) == (12, 0)
    assert report["itl_p99_ratio"] == pytest.approx(report["di"]["itl_ms"]["p99"] / report["colocated"]["itl_ms"]["p99"])


def test_tracing_comparison_has_a_closed_loop_and_traced_over_untraced_throughput() -> None:
    argv = ["--compare-tracing", "--quick"]
    args = bench_serving.parse_args(argv)
    assert (args.num_prompts, args.max_concurrency, args.request_rate) == (24, 8, float("inf"))
    args.spans_received = 40
    off = [RequestResult(4, 2, start=0.0, chunk_times=[0.1, 0.12], end=0.2, output_tokens=2)] * 4
    out = bench_serving.report(args, {"untraced": (off, 2.0), "traced": (off, 2.5)}, argv)
    assert out["traced_request_throughput_ratio"] == pytest.approx(0.8)
    assert out["traced_output_throughput_ratio"] == pytest.approx(0.8)
    assert out["spans_received"] == 40 and "spans_received" not in out["config"]
    json.dumps(out, allow_nan=False)


def test_integrity_comparison_has_a_closed_loop_and_checked_over_unchecked_ratios() -> None:
    argv = ["--compare-integrity", "--quick"]
    args = bench_serving.parse_args(argv)
    assert (args.num_prompts, args.max_concurrency, args.request_rate) == (24, 8, float("inf"))
    fast = [RequestResult(4, 2, start=0.0, chunk_times=[0.1, 0.12], end=0.2, output_tokens=2)] * 4
    slow = [RequestResult(4, 2, start=0.0, chunk_times=[0.1, 0.12], end=0.25, output_tokens=2)] * 4
    out = bench_serving.report(args, {"unchecked": (fast, 2.0), "checked": (slow, 2.5)}, argv)
    assert out["checked_e2e_p50_ratio"] == pytest.approx(1.25)
    assert out["checked_request_throughput_ratio"] == pytest.approx(0.8)
    assert "spans_received" not in out
    json.dumps(out, allow_nan=False)


def test_transport_comparison_has_its_load_and_tcp_over_shm_ratios() -> None:
    argv = ["--compare-transports", "--quick"]
    args = bench_serving.parse_args(argv)
    assert (args.num_prompts, args.max_concurrency, args.input_len_min, args.input_len_max) == (24, 8, 10, 800)
    unpinned = bench_serving.parse_args(["--compare-transports", "--cores", "none", "--threads", "2"])
    assert (unpinned.core_pair, unpinned.threads, unpinned.num_prompts) == ((None, None), 2, 200)
    shm = [RequestResult(4, 2, start=0.0, chunk_times=[0.1, 0.12], end=0.2, output_tokens=2)] * 2
    tcp = [RequestResult(4, 2, start=0.0, chunk_times=[0.12, 0.2], end=0.3, output_tokens=2)] * 2
    out = bench_serving.report(args, {"shm": (shm, 1.0), "tcp": (tcp, 1.0)}, argv)
    assert {"config", "shm", "tcp", "tcp_ttft_p50_ratio", "tcp_e2e_p50_ratio"} <= set(out)
    assert "ttft_p50_ratio" not in out
    assert out["tcp_ttft_p50_ratio"] == pytest.approx(1.2)
    assert out["tcp_e2e_p50_ratio"] == pytest.approx(1.5)
    json.dumps(out, allow_nan=False)


@pytest.mark.slow
def test_compare_transports_quick_runs_the_di_stack_over_shm_and_tcp(tmp_path: Path) -> None:
    out = tmp_path / "transports.json"
    done = run_bench("--compare-transports", "--quick", "--num-prompts", "8", "--input-len-max", "200",
                     "--model", str(tiny_model_dir(tmp_path)), "--json", str(out), timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    for name in ("shm", "tcp"):
        assert (report[name]["completed"], report[name]["failed"]) == (8, 0)
    assert report["tcp_e2e_p50_ratio"] == pytest.approx(report["tcp"]["e2e_ms"]["p50"] / report["shm"]["e2e_ms"]["p50"])
    assert "tcp_ttft_p50_ratio" in done.stdout
