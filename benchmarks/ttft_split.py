"""What a disaggregated stack's time to first token is made of, from its processes' own figures.

In the concurrent flow the client's first token is the prefill leg's answer, so TTFT is the proxy's time
before it sends the leg (parsing, tokenizing, picking workers), the leg's HTTP round trip, and the prefill
worker's time from admitting the leg to publishing its KV: waiting behind other legs plus computing the
prompt tokens it has not cached. `GET /timeline` gives the proxy's and the prefill worker's phases per
request (merged by uid); each worker's step counters give the prompt tokens it computed against those it
admitted, and the seconds it was busy. The compute share of a leg is its worker's prefill seconds per leg;
the rest of the worker's time is queueing.
"""
from __future__ import annotations

import statistics
from typing import Any, Mapping

import httpx

from common.timeline import ADMITTED, PREFILL_ANSWERED, PREFILL_SENT, PUBLISHED, RECEIVED, merged
from planner.scrape import parse

COUNTERS = {"prompt_tokens": "neuron_di_prompt_tokens_total", "computed_tokens": "neuron_di_prefill_step_tokens_total",
            "prefill_seconds": "neuron_di_prefill_step_seconds_total", "busy_seconds": "neuron_di_engine_busy_seconds_total"}


def counters(worker_urls: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """Per worker: prompt tokens admitted and computed, prefill and busy seconds (running totals)."""
    reads = {name: parse(httpx.get(f"{url}/metrics", timeout=10).text, 0.0) for name, url in worker_urls.items()}
    return {name: {key: read.value(series) or 0.0 for key, series in COUNTERS.items()} for name, read in reads.items()}


def timelines(urls: Mapping[str, str], since: float) -> dict[str, dict[str, dict[str, Any]]]:
    """uid -> source -> record for the requests the proxy received after `since` (time.time())."""
    answers = [httpx.get(f"{url}/timeline", params={"n": 100000}, timeout=10).json() for url in urls.values()]
    return {uid: sources for uid, sources in merged(answers).items()
            if sources.get("proxy", {}).get("phases", {}).get(RECEIVED, 0.0) >= since}


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def split(records: Mapping[str, Mapping[str, Mapping[str, Any]]], before: Mapping[str, Mapping[str, float]],
          after: Mapping[str, Mapping[str, float]], duration_s: float) -> dict[str, Any]:
    """Medians (ms) of the proxy's time before the prefill leg, the leg's HTTP overhead (the part of it from
    sending the leg to the worker's engine admitting it), and the prefill worker's admitted->published time; the mean compute and queueing of a leg on the prefill workers; and per
    worker its share of prompt tokens computed (1 - prefix hits) and how busy it was."""
    proxy_ms, http_ms, worker_ms, to_worker_ms = [], [], [], []
    for sources in records.values():
        proxy = sources.get("proxy", {}).get("phases", {})
        prefill = sources.get("prefill", {}).get("phases", {})
        if not {RECEIVED, PREFILL_SENT, PREFILL_ANSWERED} <= proxy.keys() or not {ADMITTED, PUBLISHED} <= prefill.keys():
            continue
        on_worker = prefill[PUBLISHED] - prefill[ADMITTED]
        proxy_ms.append(1000 * (proxy[PREFILL_SENT] - proxy[RECEIVED]))
        http_ms.append(1000 * (proxy[PREFILL_ANSWERED] - proxy[PREFILL_SENT] - on_worker))
        worker_ms.append(1000 * on_worker)
        to_worker_ms.append(1000 * (prefill[ADMITTED] - proxy[PREFILL_SENT]))
    workers: dict[str, Any] = {}
    for name in after:
        delta = {k: after[name][k] - before.get(name, {}).get(k, 0.0) for k in COUNTERS}
        workers[name] = {**delta, "computed_share": delta["computed_tokens"] / delta["prompt_tokens"]
                         if delta["prompt_tokens"] else None, "busy_share": delta["busy_seconds"] / duration_s}
    prefill = [w for name, w in workers.items() if name.startswith("prefill")]
    legs = len(worker_ms)
    compute_ms = 1000 * sum(w["prefill_seconds"] for w in prefill) / legs if legs else None
    mean_worker = statistics.fmean(worker_ms) if worker_ms else None
    return {"legs": legs, "proxy_before_leg_ms_p50": _p50(proxy_ms), "leg_http_ms_p50": _p50(http_ms),
            "leg_sent_to_admitted_ms_p50": _p50(to_worker_ms),
            "prefill_worker_ms_p50": _p50(worker_ms), "prefill_worker_ms_mean": mean_worker,
            "prefill_compute_ms_mean": compute_ms,
            "prefill_queue_ms_mean": None if compute_ms is None or mean_worker is None else mean_worker - compute_ms,
            "workers": workers}


def describe(name: str, figures: dict[str, Any]) -> str:
    """One line of a split: the medians and means (ms), and the prefill workers' computed and busy shares."""
    prefill = [w for worker, w in figures["workers"].items() if worker.startswith("prefill")]

    def ms(key: str) -> str:
        return "-" if figures[key] is None else f"{figures[key]:.0f}"

    shares = ", ".join(f"{w['computed_share'] or 0:.2f} computed / {w['busy_share']:.2f} busy" for w in prefill)
    return (f"{name}: proxy {ms('proxy_before_leg_ms_p50')} ms, leg trip {ms('leg_http_ms_p50')} ms, prefill worker "
            f"{ms('prefill_worker_ms_p50')} ms (p50); per leg: queue {ms('prefill_queue_ms_mean')} ms + compute "
            f"{ms('prefill_compute_ms_mean')} ms (mean); prefill workers: {shares}")
