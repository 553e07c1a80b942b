"""Serving metrics from per-request timestamps: TTFT, TPOT, ITL, end-to-end latency, goodput.

Pure functions over `RequestResult`s, so the arithmetic is tested on synthetic timestamps.
Definitions (all times in seconds inside, milliseconds in the summary):
- TTFT: from sending the request to the first streamed content chunk.
- ITL: the gaps between successive content chunks of one request. A chunk normally carries
  one token; a server may hold back a partial UTF-8 character and send two tokens at once.
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests with at least two output tokens.
- Largest gap: a request's longest ITL. A stall: an ITL over a multiple of the run's median ITL.
- Mean in flight: requests sent and not yet answered, averaged over the run (Little's law).
- Goodput: requests per second that finished without error, with TTFT <= the TTFT SLO and
  the request's *largest* ITL <= the ITL SLO (one stall is enough to miss it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it: times are `time.perf_counter()` values."""

    input_tokens: int
    expected_output_tokens: int
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0       # from the server's usage; the chunk count if it sent none
    error: str | None = None
    text: str = ""               # the streamed completion text

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class SLO:
    """Goodput thresholds in milliseconds; None means not judged."""

    ttft_ms: float | None = None
    itl_ms: float | None = None

    def met_by(self, result: RequestResult) -> bool:
        if not result.ok:
            return False
        if self.ttft_ms is not None and result.ttft * 1e3 > self.ttft_ms:
            return False
        itls = result.itls
        return self.itl_ms is None or not itls or max(itls) * 1e3 <= self.itl_ms


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds (linear interpolation); None for no values."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=float) * 1e3
    out: dict[str, float | None] = {"mean": float(ms.mean())}
    for p, value in zip(PERCENTILES, np.percentile(ms, PERCENTILES)):
        out[f"p{p}"] = float(value)
    return out


def summarize(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> dict[str, Any]:
    """The aggregate numbers of one run; `duration_s` runs from the first send to the last answer."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    out_tokens = sum(r.output_tokens for r in done)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return {
        "num_requests": len(results),
        "completed": len(done),
        "failed": len(failed),
        "errors": sorted({r.error or "no content" for r in failed}),
        "duration_s": duration_s,
        "total_input_tokens": sum(r.input_tokens for r in done),
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "goodput": per_s(sum(slo.met_by(r) for r in done)),
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms, "itl_rule": "max ITL of the request"},
        "ttft_ms": distribution([r.ttft for r in done]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([gap for r in done for gap in r.itls]),
        "e2e_ms": distribution([r.e2e for r in done]),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is zero."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def largest_gap(result: RequestResult) -> float | None:
    """The request's longest wait between two content chunks; None below two chunks."""
    itls = result.itls
    return max(itls) if itls else None


def median_itl(results: Sequence[RequestResult]) -> float | None:
    """The median ITL over every gap of the run's completed requests; None without gaps."""
    gaps = [gap for r in results if r.ok for gap in r.itls]
    return float(np.median(gaps)) if gaps else None


def stall_count(result: RequestResult, threshold_s: float) -> int:
    """How many of the request's ITLs exceed `threshold_s`."""
    return sum(gap > threshold_s for gap in result.itls)


def stalls_per_request(results: Sequence[RequestResult], factor: float = 3.0) -> tuple[float | None, float | None]:
    """(mean stalls per completed request, the stall threshold in s): a stall is an ITL over
    `factor` times the run's median ITL. (None, None) when the run has no ITL at all."""
    median = median_itl(results)
    done = [r for r in results if r.ok]
    if median is None or not done:
        return None, None
    threshold = factor * median
    return sum(stall_count(r, threshold) for r in done) / len(done), threshold


def mean_in_flight(results: Sequence[RequestResult], duration_s: float) -> float:
    """Requests in flight averaged over the run: their summed time in flight over its duration."""
    return sum(r.e2e for r in results) / duration_s if duration_s > 0 else 0.0


def attainment(results: Sequence[RequestResult], slo: SLO) -> float:
    """The share of all requests that met the SLO (a failed request missed it)."""
    return sum(slo.met_by(r) for r in results) / len(results) if results else 0.0
