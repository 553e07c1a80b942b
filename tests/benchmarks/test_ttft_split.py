"""benchmarks/ttft_split.py: what TTFT is made of, from timelines and step counters given as plain data."""
from __future__ import annotations

import pytest

from benchmarks.ttft_split import describe, split


def record(received: float, sent: float, admitted: float, published: float, answered: float) -> dict:
    return {"proxy": {"phases": {"received": received, "prefill_sent": sent, "prefill_answered": answered}},
            "prefill": {"phases": {"admitted": admitted, "published": published}}}


def test_split_of_two_legs_and_their_workers() -> None:
    records = {"a": record(0.0, 0.002, 0.010, 0.110, 0.120),
               "b": record(1.0, 1.004, 1.020, 1.320, 1.340),
               "no prefill leg": {"proxy": {"phases": {"received": 2.0}}}}
    before = {"prefill worker 0": {"prompt_tokens": 100, "computed_tokens": 50, "prefill_seconds": 1.0,
                                   "busy_seconds": 1.0}}
    after = {"prefill worker 0": {"prompt_tokens": 1100, "computed_tokens": 250, "prefill_seconds": 1.3,
                                  "busy_seconds": 1.3},
             "decode worker 0": {"prompt_tokens": 1000, "computed_tokens": 0, "prefill_seconds": 0.0,
                                 "busy_seconds": 0.5}}
    out = split(records, before, after, duration_s=2.0)
    assert out["legs"] == 2
    assert out["proxy_before_leg_ms_p50"] == pytest.approx(3.0)
    assert out["leg_sent_to_admitted_ms_p50"] == pytest.approx(12.0)    # 8 and 16 ms
    assert out["leg_http_ms_p50"] == pytest.approx(27.0)                # 18 and 36 ms
    assert out["prefill_worker_ms_p50"] == pytest.approx(200.0)         # 100 and 300 ms
    assert out["prefill_compute_ms_mean"] == pytest.approx(150.0)       # 0.3 s over 2 legs
    assert out["prefill_queue_ms_mean"] == pytest.approx(50.0)
    assert out["workers"]["prefill worker 0"]["computed_share"] == pytest.approx(0.2)
    assert out["workers"]["decode worker 0"]["busy_share"] == pytest.approx(0.25)
    assert "queue 50 ms + compute 150 ms" in describe("x", out)


def test_no_legs_gives_no_figures() -> None:
    out = split({}, {}, {"prefill worker 0": {"prompt_tokens": 0, "computed_tokens": 0, "prefill_seconds": 0.0,
                                              "busy_seconds": 0.0}}, 1.0)
    assert out["legs"] == 0 and out["prefill_compute_ms_mean"] is None
    assert out["workers"]["prefill worker 0"]["computed_share"] is None
    assert "queue - ms" in describe("x", out)
