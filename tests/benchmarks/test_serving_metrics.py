"""The benchmark's arithmetic on synthetic timestamps, and its synthetic load."""
from __future__ import annotations

import math

import pytest

from benchmarks.serving_load import LoadSpec, arrival_offsets, completion_body, make_requests
from benchmarks.serving_metrics import (SLO, RequestResult, attainment, distribution, largest_gap, mean_in_flight, median_itl,
                             ratio, stall_count, stalls_per_request, summarize)


def result(start: float, chunks: list[float], end: float, tokens: int, error: str | None = None) -> RequestResult:
    return RequestResult(input_tokens=10, expected_output_tokens=tokens, start=start, chunk_times=chunks,
                         end=end, output_tokens=tokens, error=error)


def test_per_request_metrics() -> None:
    r = result(1.0, [1.1, 1.15, 1.35], 1.4, 3)
    assert r.ttft == pytest.approx(0.1)
    assert r.itls == pytest.approx([0.05, 0.2])
    assert r.e2e == pytest.approx(0.4)
    assert r.tpot == pytest.approx((0.4 - 0.1) / 2)
    assert result(0.0, [0.2], 0.2, 1).tpot is None  # one token: no time per output token


def test_distribution_is_in_ms_with_linear_percentiles() -> None:
    assert distribution([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(
        {"mean": 3000.0, "p50": 3000.0, "p90": 4600.0, "p99": 4960.0})
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_slo_judges_ttft_and_the_largest_itl() -> None:
    slo = SLO(ttft_ms=150, itl_ms=100)
    assert slo.met_by(result(0.0, [0.1, 0.15, 0.2], 0.2, 3))
    assert not slo.met_by(result(0.0, [0.2, 0.25], 0.25, 2))          # TTFT 200 ms
    assert not slo.met_by(result(0.0, [0.1, 0.15, 0.3], 0.3, 3))      # one ITL of 150 ms
    assert not slo.met_by(result(0.0, [0.1], 0.1, 1, error="HTTP 503: busy"))
    assert SLO().met_by(result(0.0, [9.0, 19.0], 19.0, 2))            # no thresholds: any success


def test_summary_counts_throughput_and_goodput() -> None:
    results = [result(0.0, [0.1, 0.2], 0.2, 2), result(0.5, [0.6, 0.9], 0.9, 2),
               result(1.0, [], 1.0, 0, error="HTTP 500: boom"), result(1.0, [], 2.0, 0, error="HTTP 500: boom")]
    s = summarize(results, duration_s=2.0, slo=SLO(ttft_ms=150, itl_ms=150))
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 2, 2)
    assert s["errors"] == ["HTTP 500: boom"]
    assert s["total_output_tokens"] == 4 and s["total_input_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["goodput"] == pytest.approx(0.5)  # the second request has a 300 ms ITL
    assert s["ttft_ms"]["mean"] == pytest.approx(100.0)
    assert s["itl_ms"]["p50"] == pytest.approx(200.0)  # gaps 100 and 300 ms
    assert s["tpot_ms"]["mean"] == pytest.approx(200.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(300.0)


def test_largest_gap_and_stalls_per_request() -> None:
    steady = result(0.0, [0.5, 0.51, 0.52, 0.53, 0.54], 0.54, 5)    # gaps 10 ms
    stalled = result(0.0, [0.5, 0.51, 0.56, 0.57, 0.65], 0.65, 5)   # gaps 10, 50, 10, 80 ms
    failed = result(0.0, [0.5, 0.9, 1.9], 2.0, 3, error="stream ended without [DONE]")
    assert largest_gap(steady) == pytest.approx(0.01) and largest_gap(stalled) == pytest.approx(0.08)
    assert largest_gap(result(0.0, [0.5], 0.5, 1)) is None
    assert stall_count(stalled, 0.03) == 2 and stall_count(steady, 0.03) == 0
    # The failed request's gaps count neither in the median nor as stalls: median of 8 gaps, 6 of 10 ms.
    assert median_itl([steady, stalled, failed]) == pytest.approx(0.01)
    per_request, threshold = stalls_per_request([steady, stalled, failed], factor=3.0)
    assert threshold == pytest.approx(0.03)
    assert per_request == pytest.approx(1.0)  # 0 + 2 stalls over two completed requests
    per_request, threshold = stalls_per_request([steady, stalled], factor=6.0)
    assert (per_request, threshold) == (pytest.approx(0.5), pytest.approx(0.06))  # only the 80 ms gap
    assert stalls_per_request([result(0.0, [0.5], 0.5, 1)]) == (None, None)


def test_mean_in_flight_and_attainment() -> None:
    # Two requests of 2 s and one of 1 s over a 4 s run: 1.25 in flight on average.
    results = [result(0.0, [1.0, 1.05], 2.0, 2), result(1.0, [1.5, 1.6], 3.0, 2),
               result(3.0, [], 4.0, 0, error="HTTP 503: busy")]
    assert mean_in_flight(results, 4.0) == pytest.approx(1.25)
    assert mean_in_flight(results, 0.0) == 0.0
    # The first meets TTFT 1 s / gap 60 ms; the second's gap is 100 ms; the third failed.
    assert attainment(results, SLO(ttft_ms=1000, itl_ms=60)) == pytest.approx(1 / 3)
    assert attainment(results, SLO(ttft_ms=1000, itl_ms=100.5)) == pytest.approx(2 / 3)
    assert attainment([], SLO()) == 0.0


def test_ratio() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None


def test_synthetic_requests_are_seeded_and_in_range() -> None:
    spec = LoadSpec(num_prompts=50, input_len=(5, 9), output_len=(2, 4), seed=7)
    requests = make_requests(spec)
    assert requests == make_requests(spec)
    assert requests != make_requests(LoadSpec(50, (5, 9), (2, 4), seed=8))
    assert {len(r.prompt_token_ids) for r in requests} == {5, 6, 7, 8, 9}
    assert {r.output_len for r in requests} == {2, 3, 4}
    assert all(32 <= t <= 126 for r in requests for t in r.prompt_token_ids)
    body = completion_body("m", requests[0])
    assert body["max_tokens"] == requests[0].output_len and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_poisson_arrivals() -> None:
    assert arrival_offsets(4, math.inf, seed=0) == [0.0] * 4
    offsets = arrival_offsets(4000, 8.0, seed=0)
    assert offsets == arrival_offsets(4000, 8.0, seed=0)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(1 / 8.0, rel=0.05)  # mean gap 1/rate


@pytest.mark.parametrize("kwargs", [dict(num_prompts=0), dict(input_len=(5, 4)), dict(output_len=(0, 3)),
                                    dict(request_rate=0.0), dict(max_concurrency=0)])
def test_load_spec_rejects_bad_values(kwargs: dict) -> None:
    base = dict(num_prompts=1, input_len=(1, 2), output_len=(1, 2))
    with pytest.raises(ValueError):
        LoadSpec(**{**base, **kwargs})
