"""The mixed workload of bench_serving.py --compare-conditional: its requests, flags, ratios and a quick run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_serving
from benchmarks.serving_mixed import MixedWorkload, conditional_flags, mixed_ratios, mixed_requests

from tests.benchmarks.test_bench_serving import run_bench
from worker.model.loader import builtin_model_path


def test_mixed_requests_are_short_turns_and_long_documents() -> None:
    workload = MixedWorkload(short_share=0.75, short_input=(4, 8), short_output=(2, 3), long_input=(50, 60),
                             long_output=(9, 9))
    requests = mixed_requests(workload, 400, seed=7)
    assert requests == mixed_requests(workload, 400, seed=7) and requests != mixed_requests(workload, 400, seed=8)
    short = [r for r in requests if len(r.prompt_token_ids) <= 8]
    long = [r for r in requests if len(r.prompt_token_ids) >= 50]
    assert len(short) + len(long) == 400 and 0.68 < len(short) / 400 < 0.82
    assert all(2 <= r.output_len <= 3 for r in short) and all(r.output_len == 9 for r in long)


def test_compare_conditional_command_line() -> None:
    args = bench_serving.parse_args(["--compare-conditional"])
    assert (args.rates, args.seconds_per_rate, args.goodput_attainment) == ([0.5, 0.75, 1, 1.25, 1.5, 2, 3], 24.0, 0.9)
    assert bench_serving.parse_args(["--compare-conditional", "--quick"]).rates == [1.0]
    assert conditional_flags(args, "/m") == ("--conditional-disaggregation", "--tokenizer", "/m")
    tuned = bench_serving.parse_args(["--compare-conditional", "--max-local-prefill-tokens", "64",
                                      "--max-prefill-queue", "3"])
    assert conditional_flags(tuned, "/m")[3:] == ("--max-local-prefill-tokens", "64", "--max-prefill-queue", "3")
    assert tuned.systems == ["conditional", "disaggregated", "colocated"] and tuned.ours_extra == []
    picked = bench_serving.parse_args(["--compare-conditional", "--systems", "conditional",
                                       "--ours-extra=--max-num-batched-tokens 128"])
    assert (picked.systems, picked.ours_extra) == (["conditional"], ["--max-num-batched-tokens", "128"])
    for bad in (["--rates", "2,1"], ["--systems", "vllm"]):
        with pytest.raises(SystemExit):
            bench_serving.parse_args(["--compare-conditional", *bad])


def test_ratios_are_conditional_goodput_over_the_others() -> None:
    systems = {"conditional": {"goodput_rps": 3.0}, "disaggregated": {"goodput_rps": 2.0},
               "colocated": {"goodput_rps": 0.0}}
    assert mixed_ratios(systems) == {"conditional_over_disaggregated": 1.5, "conditional_over_colocated": None}


@pytest.mark.slow
def test_compare_conditional_quick_runs_the_three_stacks(tmp_path: Path) -> None:
    out = tmp_path / "conditional.json"
    done = run_bench("--compare-conditional", "--quick", "--model", str(builtin_model_path()), "--json", str(out),
                     timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert list(report["systems"]) == ["conditional", "disaggregated", "colocated"]
    for system in report["systems"].values():
        assert [(p["completed"], p["failed"]) for p in system["rates"]] == [(6, 0)]
    paths = report["systems"]["conditional"]["paths"]
    assert paths["local"] + paths["remote"] == 6 + 2  # the load and the warm-up
    assert set(report["ratios"]) == {"conditional_over_disaggregated", "conditional_over_colocated"}
