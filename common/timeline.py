"""Per-request timelines of disaggregated requests: when each phase happened, in each process.

Every process a disaggregated request goes through (the proxy, the prefill worker, the decode
worker; our worker or `vllm serve` with NeuronConnector) keeps a `Timeline`: for the last
`capacity` requests, the wall-clock time (`time.time()`, comparable between the processes of
one host) at which each phase below happened there, keyed by the request id both legs carry
(the proxy's uid). Each span (the time between two phases of one process) is also observed in
a Prometheus histogram, `neuron_di_timeline_seconds{span=...}`. Marking a phase is a dict
update under a lock: cheap enough to stay on.

`GET /timeline` on the proxy, our worker and NeuronConnector's status server answers
`{"source": ..., "requests": [record, ...]}` (oldest first; `?uid=ID` for one request, `?n=N` for the
last N); `examples/timeline.py` merges them by uid. A record:

    {"uid": "...", "source": "decode", "phases": {"admitted": 1767.1, ...}, "tokens": [...],
     "error": null}

`tokens` (proxy only, streamed answers): when each token's chunk reached the proxy.

With tracing on, the timeline's `listener` (common/trace_spans.py) turns the phases into trace spans.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from prometheus_client import CollectorRegistry, Histogram

PROXY, PREFILL, DECODE = "proxy", "prefill", "decode"

# The proxy's phases.
RECEIVED = "received"                  # the client's request arrived
PREFILL_SENT = "prefill_sent"          # the prefill leg went out
PREFILL_ANSWERED = "prefill_answered"  # prefill's answer (the first token) came back
DECODE_SENT = "decode_sent"            # the decode leg went out
DECODE_FIRST = "decode_first"          # decode's first chunk came back (its copy of the first token)
DONE = "done"                          # the answer ended (sent whole, or the stream's last event)
# A prefill worker's phases.
ADMITTED = "admitted"                  # the leg entered the engine (decode: its blocks were allocated)
PUBLISHED = "published"                # prefill done: the blocks wait for the decode peer's lookup
PUSH_STARTED = "push_started"          # a lookup found them: the push into decode's blocks began
PUSH_DONE = "push_done"                # the push ended
RELEASED = "released"                  # the blocks were freed (pulled, released, or timed out)
DECODE_DONE = "decode_done"            # the decode peer said it is done: the KV is in its blocks, or it let go
# A decode worker's phases (ADMITTED too).
PULL_STARTED = "pull_started"          # the pull was registered with the signal plane's thread
LOOKUP_ANSWERED = "lookup_answered"    # prefill's answer to the lookup arrived: the KV is in our blocks
PULL_REPORTED = "pull_reported"        # the engine learned the pull is done
FIRST_STEP = "first_step"              # the first engine step that runs the request after its pull

PHASES = {PROXY: (RECEIVED, PREFILL_SENT, PREFILL_ANSWERED, DECODE_SENT, DECODE_FIRST, DONE),
          PREFILL: (ADMITTED, PUBLISHED, PUSH_STARTED, PUSH_DONE, RELEASED, DECODE_DONE),
          DECODE: (ADMITTED, PULL_STARTED, LOOKUP_ANSWERED, PULL_REPORTED, FIRST_STEP)}

# Span name -> (from phase, to phase), per source: each is a histogram series.
SPANS = {
    PROXY: {"prefill_leg": (PREFILL_SENT, PREFILL_ANSWERED), "decode_first": (PREFILL_ANSWERED, DECODE_FIRST),
            "request": (RECEIVED, DONE)},
    PREFILL: {"prefill": (ADMITTED, PUBLISHED), "wait_for_lookup": (PUBLISHED, PUSH_STARTED),
              "push": (PUSH_STARTED, PUSH_DONE), "held": (PUBLISHED, RELEASED)},
    DECODE: {"wait_for_kv": (PULL_STARTED, LOOKUP_ANSWERED), "pull_report": (LOOKUP_ANSWERED, PULL_REPORTED),
             "schedule_after_pull": (PULL_REPORTED, FIRST_STEP), "admitted_to_first_step": (ADMITTED, FIRST_STEP)},
}
# The proxy's token spans: its first token's wait, and each answer's largest gap between two tokens.
TOKEN_SPANS = ("time_to_first_token", "largest_gap")
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class PhaseListener(Protocol):
    """Told of every phase as it is marked (common/trace_spans.py turns them into trace spans)."""

    def phase(self, uid: str, phase: str, at: float) -> None: ...

    def fail(self, uid: str, error: str) -> None: ...


@dataclass(slots=True)
class _Record:
    uid: str
    phases: dict[str, float] = field(default_factory=dict)
    tokens: list[float] = field(default_factory=list)
    error: str | None = None


class Timeline:
    """The recent requests of one process (`source`: proxy, prefill or decode) and its span histograms.

    Thread-safe; the first mark of a phase wins (a resent message does not move it)."""

    def __init__(self, source: str, capacity: int = 512, registry: CollectorRegistry | None = None) -> None:
        if source not in PHASES:
            raise ValueError(f"timeline source must be one of {sorted(PHASES)}, got {source!r}")
        self.source = source
        self.capacity = capacity
        self.registry = registry if registry is not None else CollectorRegistry()
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._lock = threading.Lock()
        self._spans = SPANS[source]
        self.listener: PhaseListener | None = None
        self._histogram = Histogram("neuron_di_timeline_seconds", "Time between two phases of disaggregated "
                                    "requests in this process, by span (common/timeline.py)", ["span"],
                                    buckets=_BUCKETS, registry=self.registry)
        for span in (*self._spans, *(TOKEN_SPANS if source == PROXY else ())):
            self._histogram.labels(span)  # every series exported from the start

    def mark(self, uid: str, phase: str, at: float | None = None) -> None:
        """`phase` of request `uid` happened at `at` (default: now)."""
        at = time.time() if at is None else at
        with self._lock:
            record = self._record(uid)
            if phase in record.phases:
                return
            record.phases[phase] = at
            observed = [(span, at - record.phases[start]) for span, (start, end) in self._spans.items()
                        if end == phase and start in record.phases]
        for span, seconds in observed:
            self._histogram.labels(span).observe(max(0.0, seconds))
        if self.listener is not None:
            self.listener.phase(uid, phase, at)

    def token(self, uid: str, at: float | None = None) -> None:
        """One token of `uid`'s streamed answer reached the proxy."""
        at = time.time() if at is None else at
        with self._lock:
            record = self._record(uid)
            record.tokens.append(at)
            first = len(record.tokens) == 1 and RECEIVED in record.phases
            received = record.phases.get(RECEIVED, at)
        if first:
            self._histogram.labels("time_to_first_token").observe(max(0.0, at - received))

    def finish(self, uid: str, error: str | None = None) -> None:
        """The request ended here (with `error`, if it failed); the proxy also observes its largest gap."""
        now = time.time()
        with self._lock:
            record = self._record(uid)
            if error is not None and record.error is None:
                record.error = error
            tokens = list(record.tokens)
        if error is not None and self.listener is not None:
            self.listener.fail(uid, error)
        if self.source == PROXY:
            self.mark(uid, DONE, now)
            if len(tokens) > 1:
                self._histogram.labels("largest_gap").observe(max(b - a for a, b in zip(tokens, tokens[1:])))

    def fail(self, uid: str, error: str) -> None:
        """Records why the request failed in this process (the first reason wins)."""
        with self._lock:
            record = self._record(uid)
            if record.error is None:
                record.error = error
        if self.listener is not None:
            self.listener.fail(uid, error)

    def get(self, uid: str) -> dict[str, Any] | None:
        with self._lock:
            record = self._records.get(uid)
            return None if record is None else self._to_dict(record)

    def recent(self, n: int | None = None) -> list[dict[str, Any]]:
        """The last `n` requests (all kept, if None), oldest first."""
        with self._lock:
            records = list(self._records.values())
            return [self._to_dict(r) for r in (records if n is None else records[-n:] if n > 0 else [])]

    def answer(self, uid: str | None = None, n: int | None = None) -> dict[str, Any]:
        """The `GET /timeline` body: one request (`uid`), or the last `n`."""
        if uid is not None:
            record = self.get(uid)
            return {"source": self.source, "requests": [record] if record is not None else []}
        return {"source": self.source, "requests": self.recent(n)}

    def _record(self, uid: str) -> _Record:
        record = self._records.get(uid)
        if record is None:
            record = self._records[uid] = _Record(uid)
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
        return record

    def _to_dict(self, record: _Record) -> dict[str, Any]:
        return {"uid": record.uid, "source": self.source, "phases": dict(record.phases),
                "tokens": list(record.tokens), "error": record.error}


def parse_query(args: Any) -> tuple[str | None, int | None]:
    """`uid` and `n` from a `GET /timeline` query (a mapping of strings); ValueError for a bad `n`."""
    uid = args.get("uid") or None
    n = args.get("n")
    if n is None or n == "":
        return uid, None
    count = int(n)
    if count < 0:
        raise ValueError("n must not be negative")
    return uid, count


def merged(answers: Iterable[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """uid -> source -> record, from `GET /timeline` answers of several processes."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for answer in answers:
        for record in answer.get("requests", []):
            out.setdefault(record["uid"], {})[record["source"]] = record
    return out
