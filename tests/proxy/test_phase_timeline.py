"""The proxy's phase histograms and GET /status's pure parts: phases from marks, a worker's load from its
metrics page, the launchers' summary text."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from common.timeline import DECODE_FIRST, DECODE_SENT, PREFILL_ANSWERED
from proxy.phase_timeline import PhaseTimeline
from proxy.worker_load import WorkerLoad, parse_load
from stack.status_summary import summary

T0 = 1_000.0


def _count(registry: CollectorRegistry, phase: str, flow: str, path: str) -> float | None:
    return registry.get_sample_value("proxy_phase_seconds_count", {"phase": phase, "flow": flow, "path": path})


def test_a_finished_request_is_observed_once_per_phase_under_its_flow_and_path() -> None:
    registry = CollectorRegistry()
    timeline = PhaseTimeline(registry)
    timeline.begin("a", "concurrent", "remote", T0)
    timeline.mark("a", PREFILL_ANSWERED, T0 + 0.1)
    timeline.token("a", T0 + 0.11)
    timeline.mark("a", DECODE_FIRST, T0 + 0.4)
    timeline.finish("a")
    timeline.finish("a")  # a second end is not a second request
    for phase in ("prefill_answer", "decode_first", "handoff", "first_token", "request"):
        assert _count(registry, phase, "concurrent", "remote") == 1, phase
    assert registry.get_sample_value("proxy_phase_seconds_sum", {"phase": "handoff", "flow": "concurrent",
                                                                 "path": "remote"}) == pytest.approx(0.3)
    share = {"flow": "concurrent", "path": "remote"}
    assert registry.get_sample_value("proxy_transfer_share_ratio_sum", share) == pytest.approx(0.75)
    figures = timeline.percentiles()
    assert figures["first_token"] == {"count": 1, "p50": 0.11, "p90": 0.11, "p99": 0.11}


def test_local_requests_have_no_prefill_phases_and_failed_ones_are_not_observed() -> None:
    registry = CollectorRegistry()
    timeline = PhaseTimeline(registry)
    timeline.begin("local", "local", "local", T0)
    timeline.mark("local", DECODE_SENT, T0 + 0.01)
    timeline.mark("local", DECODE_FIRST, T0 + 0.2)
    timeline.finish("local")
    timeline.begin("failed", "prefill_first", "remote", T0)
    timeline.mark("failed", PREFILL_ANSWERED, T0 + 0.1)
    timeline.finish("failed", "decode worker 127.0.0.1:1: connection refused")
    assert _count(registry, "decode_first", "local", "local") == _count(registry, "request", "local", "local") == 1
    assert _count(registry, "prefill_answer", "local", "local") is None
    assert _count(registry, "prefill_answer", "prefill_first", "remote") is None
    assert set(timeline.percentiles()) == {"decode_first", "request"}


def test_percentiles_are_nearest_rank_over_the_last_window() -> None:
    timeline = PhaseTimeline(CollectorRegistry(), window=100)
    for i in range(150):  # the first 50 fall out of the window
        uid = f"r{i}"
        timeline.begin(uid, "concurrent", "remote", T0)
        timeline.mark(uid, PREFILL_ANSWERED, T0 + (i + 1) / 1000)
        timeline.finish(uid)
    assert timeline.percentiles()["prefill_answer"] == {"count": 100, "p50": 0.1, "p90": 0.14, "p99": 0.149}


def test_load_from_our_workers_series_and_from_vllms() -> None:
    ours = parse_load('neuron_di_kv_blocks_used{model_name="m"} 3.0\nneuron_di_kv_blocks_total{model_name="m"} 12.0\n'
                      'neuron_di_requests_running{model_name="m"} 1.0\nneuron_di_requests_waiting{model_name="m"} 0\n')
    assert ours == WorkerLoad(kv_usage=0.25, kv_blocks_used=3, kv_blocks_total=12, running=1, waiting=0)
    vllm = parse_load('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
                      'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n')
    assert vllm.to_dict() == {"kv_usage": 0.5, "running": 2.0}


def test_the_summary_fits_one_screen_and_says_what_is_wrong() -> None:
    status = {"workers": {"prefill": [{"address": "127.0.0.1:8100", "healthy": True, "draining": False,
                                       "in_flight": 2, "load": {"kv_usage": 0.125, "running": 1, "waiting": 3}}],
                          "decode": [{"address": "127.0.0.1:8200", "healthy": False, "draining": False,
                                      "in_flight": 0, "load": None, "load_error": "connection refused"}]},
              "prefill_queue_depth": 4, "requests": {"200": 9, "503": 1},
              "phases": {"request": {"count": 10, "p50": 0.5, "p90": 0.9, "p99": 1.0}}}
    text = summary(status, "12:00:00")
    assert "prefill  127.0.0.1:8100        healthy   in flight   2  KV  12.5%  running 1  waiting 3" in text
    assert "decode   127.0.0.1:8200        DOWN      in flight   0  load unknown (connection refused)" in text
    assert "prefill queue 4   answers 9 x 200, 1 x 503" in text
    assert "request             500.0    900.0   1000.0     10" in text
    assert len(text.splitlines()) <= 24
