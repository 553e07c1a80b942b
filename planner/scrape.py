"""Prometheus text in, samples out: counters summed over labels, histogram buckets, percentiles of a delta."""
from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class Scrape:
    """One read of a /metrics page: every sample's value summed over its labels, by sample name, and
    each histogram's cumulative buckets (upper bound -> count), by metric name."""

    at: float
    values: dict[str, float]
    buckets: dict[str, dict[float, float]]

    def value(self, name: str) -> float | None:
        return self.values.get(name)


def parse(text: str, at: float) -> Scrape:
    """A Scrape of `text`; ValueError when it is not Prometheus text."""
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and "le" in sample.labels:
                bounds = buckets.setdefault(family.name, {})
                bound = float(sample.labels["le"])
                bounds[bound] = bounds.get(bound, 0.0) + sample.value
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return Scrape(at, values, buckets)


def delta(now: Scrape, before: Scrape, name: str) -> float | None:
    """How much counter `name` grew between the two reads; None if missing or reset (it went down)."""
    a, b = now.value(name), before.value(name)
    if a is None or b is None or a < b:
        return None
    return a - b


def percentile(now: Scrape, before: Scrape, histogram: str, q: float) -> tuple[float | None, int]:
    """(The q-quantile of the observations between the reads, linear within a bucket as Prometheus'
    histogram_quantile does; their number). (None, n) when there are none or the buckets are missing."""
    upper, lower = now.buckets.get(histogram), before.buckets.get(histogram, {})
    if not upper:
        return None, 0
    counts = [(bound, upper[bound] - lower.get(bound, 0.0)) for bound in sorted(upper)]
    total = counts[-1][1]
    if total <= 0:
        return None, 0
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in counts:
        if count >= rank:
            if math.isinf(bound):
                return previous_bound, int(total)   # above the last finite bucket: its bound is all we know
            share = (rank - previous_count) / (count - previous_count) if count > previous_count else 1.0
            return previous_bound + (bound - previous_bound) * share, int(total)
        previous_bound, previous_count = bound, count
    return previous_bound, int(total)
