"""Where each request's time went, as Prometheus histograms the proxy exports (no tracing needed).

The proxy's timeline (common/timeline.py) marks when a request arrived, when the prefill answer and
decode's first token came back, each streamed token, and its end. When a request ends, its phases
are observed in `proxy_phase_seconds{phase, flow, path}`:

    prefill_answer   arrival -> the prefill worker's answer (its first token)      remote path
    decode_first     arrival -> decode's first chunk (its copy of the first token) remote path
    handoff          prefill answer -> decode's first chunk: the KV transfer, decode's admission
                     and its first step; what disaggregation adds to the first token
    first_token      arrival -> the client's first streamed token                  streamed
    request          arrival -> the answer's end

and the handoff's share of decode's first token in `proxy_transfer_share_ratio{flow, path}`.
`flow`: concurrent, prefill_first, decode_first (the flow of a disaggregated request), or local
(conditional disaggregation kept it on a decode worker: `path` local). `percentiles()` gives the
percentiles of each phase over the last requests, for GET /status.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from common.timeline import DECODE_FIRST, DONE, PREFILL_ANSWERED, PROXY, RECEIVED, Timeline

LOCAL, REMOTE = "local", "remote"
PHASES = ("prefill_answer", "decode_first", "handoff", "first_token", "request")
_FROM_TO = {"prefill_answer": (RECEIVED, PREFILL_ANSWERED), "decode_first": (RECEIVED, DECODE_FIRST),
            "handoff": (PREFILL_ANSWERED, DECODE_FIRST), "request": (RECEIVED, DONE)}
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
_SHARE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)
QUANTILES = (0.5, 0.9, 0.99)


class PhaseTimeline(Timeline):
    """The proxy's timeline, which also observes each finished request's phases by flow and path, and keeps
    the last `window` samples of each phase for `percentiles()`."""

    def __init__(self, registry: CollectorRegistry, capacity: int = 512, window: int = 256) -> None:
        super().__init__(PROXY, capacity, registry)
        self._labels: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._samples = {phase: deque[float](maxlen=window) for phase in PHASES}
        self._samples_lock = threading.Lock()
        self.phases = Histogram("proxy_phase_seconds", "Time of each phase of a request at the proxy, by flow "
                                "and path (proxy/phase_timeline.py)", ["phase", "flow", "path"],
                                buckets=_BUCKETS, registry=registry)
        self.share = Histogram("proxy_transfer_share_ratio", "Share of the time to decode's first token spent "
                               "between the prefill answer and it (KV transfer, admission, first step)",
                               ["flow", "path"], buckets=_SHARE_BUCKETS, registry=registry)

    def begin(self, uid: str, flow: str, path: str = REMOTE, at: float | None = None) -> None:
        """Request `uid` arrived (at `at`, time.time()) and goes `flow` on `path`."""
        with self._samples_lock:
            self._labels[uid] = (flow, path)
            while len(self._labels) > self.capacity:
                self._labels.popitem(last=False)
        self.mark(uid, RECEIVED, at)

    def finish(self, uid: str, error: str | None = None) -> None:
        super().finish(uid, error)
        with self._samples_lock:
            labels = self._labels.pop(uid, None)
        record = self.get(uid)
        if labels is None or record is None or record["error"] is not None:
            return
        self._observe(record, *labels)

    def _observe(self, record: dict[str, Any], flow: str, path: str) -> None:
        marks = record["phases"]
        took = {phase: marks[end] - marks[start] for phase, (start, end) in _FROM_TO.items()
                if start in marks and end in marks}
        if record["tokens"] and RECEIVED in marks:
            took["first_token"] = record["tokens"][0] - marks[RECEIVED]
        with self._samples_lock:
            for phase, seconds in took.items():
                self._samples[phase].append(max(0.0, seconds))
        for phase, seconds in took.items():
            self.phases.labels(phase, flow, path).observe(max(0.0, seconds))
        if took.get("decode_first", 0.0) > 0 and "handoff" in took:
            self.share.labels(flow, path).observe(min(1.0, max(0.0, took["handoff"] / took["decode_first"])))

    def percentiles(self) -> dict[str, dict[str, float | int]]:
        """Per phase, over its last samples: their count and p50/p90/p99 in seconds (phases with none left out)."""
        with self._samples_lock:
            samples = {phase: sorted(values) for phase, values in self._samples.items() if values}
        return {phase: {"count": len(values), **{f"p{round(q * 100)}": _quantile(values, q) for q in QUANTILES}}
                for phase, values in samples.items()}


def _quantile(ordered: list[float], q: float) -> float:
    """The nearest-rank `q` quantile of sorted, non-empty `ordered`."""
    rank = max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))
    return round(ordered[rank], 6)
