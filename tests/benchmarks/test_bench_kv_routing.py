"""bench_kv_routing.py's command line and report, on plain results: which loads run and which ratio heads."""
from __future__ import annotations

import pytest

from benchmarks import bench_kv_routing
from benchmarks.bench_kv_routing import loads, parse, report
from benchmarks.serving_metrics import RequestResult


def test_loads_closed_by_default_open_loop_with_rates() -> None:
    assert loads(None, None) == [None]
    assert loads("1.0,0.8", None) == [1.0, 0.8]
    assert loads("1.0, 0.8", True) == [None, 1.0, 0.8]
    for bad, closed in (("0", None), ("-1", None), ("x", None), ("", None), (None, False)):
        with pytest.raises(ValueError):
            loads(bad, closed)


def test_bad_command_lines_exit_2() -> None:
    for argv in (["--session-rate", "0"], ["--no-closed-loop"], ["--think-time", "-1"],
                 ["--session-rate", "1", "--synthetic-trace", "5"], ["--topologies", "3p3d"]):
        with pytest.raises(SystemExit) as exited:
            parse(argv)
        assert exited.value.code == 2


def runs_with_ttft(ttfts_ms: dict[str, float]) -> dict:
    """Each run: one request with that TTFT, and the route counters of a KV-routed run."""
    counts = {"prompt": 100.0, "hit": 90.0, "best": 100.0, "ttft_split": {}, "offered_load": {}}
    return {name: ([RequestResult(10, 2, start=0.0, chunk_times=[ms / 1000, ms / 1000 + 0.01], end=0.02,
                                  output_tokens=2)], 1.0, counts) for name, ms in ttfts_ms.items()}


def test_the_first_open_loop_rate_heads_and_the_closed_loop_ratio_stays() -> None:
    args = parse(["--topologies", "2p2d", "--session-rate", "1,2", "--closed-loop"])
    runs = runs_with_ttft({"2p2d_round_robin": 400, "2p2d_kv": 200, "2p2d_open1_round_robin": 300,
                           "2p2d_open1_kv": 120, "2p2d_open2_round_robin": 500, "2p2d_open2_kv": 100})
    ratios = report(args, runs, ["--session-rate", "1,2"], (0.0,), (0.0,))["ratios"]
    assert ratios["kv_over_round_robin_ttft_p50"] == pytest.approx(0.4)
    assert ratios["closed_loop_kv_over_round_robin_ttft_p50"] == pytest.approx(0.5)
    assert ratios["2p2d_open2_kv_over_round_robin_ttft_p50"] == pytest.approx(0.2)
    assert ratios["prefix_hit_share"] == pytest.approx(0.9)
    out = report(args, runs, [], (0.0,), (0.0,))
    assert out["config"]["headline"] == "open loop, 1 chats/s per prefill worker, 2p2d"
    closed = report(parse(["--topologies", "2p2d"]), runs, [], (0.0,), (0.0,))
    assert closed["ratios"]["kv_over_round_robin_ttft_p50"] == pytest.approx(0.5)
    assert closed["config"]["headline"] == bench_kv_routing.HEADLINE_CLOSED


def test_conditional_disaggregation_goes_to_both_proxies_with_the_tokenizer_it_needs() -> None:
    plain = parse([])
    assert bench_kv_routing.stack_options(plain, "round_robin").proxy_extra == ()
    assert bench_kv_routing.stack_options(plain, "kv").proxy_extra == ("--routing", "kv", "--tokenizer", "builtin")
    both = parse(["--conditional-disaggregation"])
    assert bench_kv_routing.stack_options(both, "round_robin").proxy_extra == (
        "--tokenizer", "builtin", "--conditional-disaggregation")
    assert bench_kv_routing.stack_options(both, "kv").proxy_extra == (
        "--routing", "kv", "--tokenizer", "builtin", "--conditional-disaggregation")
