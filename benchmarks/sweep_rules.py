"""The rate sweep's pure decisions: the rates, one rate's summary, goodput, when to stop, the rate near a batch size.

A sweep point is the dict `rate_point` returns; the rules read only its `rate_rps`,
`slo_attainment`, `mean_in_flight` and `stalls_per_request`, so tests drive them with plain dicts.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from benchmarks.serving_metrics import (SLO, RequestResult, attainment, distribution, largest_gap, mean_in_flight,
                             stalls_per_request, summarize)


def parse_rates(text: str) -> list[float]:
    """"0.5,1,2" -> [0.5, 1.0, 2.0]: finite, positive and rising, else ValueError."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError as exc:
        raise ValueError(f"--rates: expected numbers like 0.5,1,2, got {text!r}") from exc
    if not rates or not all(0 < r < math.inf for r in rates) or any(a >= b for a, b in zip(rates, rates[1:])):
        raise ValueError(f"--rates: need finite positive rates in rising order, got {text!r}")
    return rates


def rate_point(rate_rps: float, results: Sequence[RequestResult], duration_s: float, slo: SLO,
               stall_factor: float) -> dict[str, Any]:
    """Everything measured at one offered rate: the run's summary plus attainment, largest gaps,
    stalls per request and the mean number of requests in flight."""
    stalls, threshold_s = stalls_per_request(results, stall_factor)
    gaps = [g for g in (largest_gap(r) for r in results if r.ok) if g is not None]
    return {"rate_rps": rate_rps, **summarize(results, duration_s, slo),
            "slo_attainment": attainment(results, slo),
            "mean_in_flight": mean_in_flight(results, duration_s),
            "largest_gap_ms": distribution(gaps),
            "stall_threshold_ms": None if threshold_s is None else threshold_s * 1e3,
            "stalls_per_request": stalls}


def goodput_rps(points: Sequence[Mapping[str, Any]], min_attainment: float) -> float:
    """The highest measured rate at which at least `min_attainment` of requests met the SLO; 0 if none."""
    return max((p["rate_rps"] for p in points if p["slo_attainment"] >= min_attainment), default=0.0)


def should_stop(points: Sequence[Mapping[str, Any]], floor: float, in_a_row: int = 2) -> bool:
    """True once the last `in_a_row` rates were each below `floor` attainment: higher rates only do worse."""
    last = points[-in_a_row:]
    return len(last) == in_a_row and all(p["slo_attainment"] < floor for p in last)


def near_batch(points: Sequence[Mapping[str, Any]], batch: float, engines: int = 1) -> dict[str, Any] | None:
    """Stalls per request at the rate whose running batch is closest to `batch`; None without points.

    The batch is estimated from the client's side: requests in flight shared by the `engines`
    that decode them (two colocated workers each run about half)."""
    if not points:
        return None
    best = min(points, key=lambda p: abs(p["mean_in_flight"] / engines - batch))
    return {"batch_target": batch, "rate_rps": best["rate_rps"], "mean_batch": best["mean_in_flight"] / engines,
            "stalls_per_request": best["stalls_per_request"]}
