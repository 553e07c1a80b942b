"""What the proxy times: per answer its TTFT, inter-token and end-to-end latency (metrics), and per
disaggregated request the phases of its timeline (common/timeline.py)."""
from __future__ import annotations

import time

from common.timeline import DECODE_FIRST, DECODE_SENT, PREFILL_ANSWERED, PREFILL_SENT, Timeline
from common.trace_spans import LEG_SPAN, spans_of
from proxy.metrics import Metrics

REQUEST_ID_HEADER = "X-Request-Id"
_SENT = {"prefill": PREFILL_SENT, "decode": DECODE_SENT}


class AnswerTimer:
    """Observes TTFT, inter-token latency and end-to-end latency of one streamed answer, and (with a
    `uid`) marks each token's arrival and the answer's end on the proxy's timeline."""

    def __init__(self, metrics: Metrics, started: float, timeline: Timeline | None = None,
                 uid: str | None = None) -> None:
        self._metrics = metrics
        self._started = started
        self._last: float | None = None
        self._timeline = timeline if uid is not None else None
        self._uid = uid or ""

    def tick(self) -> None:
        now = time.perf_counter()
        if self._last is None:
            self._metrics.ttft.observe(now - self._started)
        else:
            self._metrics.itl.observe(now - self._last)
        self._last = now
        if self._timeline is not None:
            self._timeline.token(self._uid)

    def done(self, error: str | None = None) -> None:
        self._metrics.e2e.observe(time.perf_counter() - self._started)
        if self._timeline is not None:
            self._timeline.finish(self._uid, error)


def leg_sent(timeline: Timeline, role: str, headers: dict[str, str]) -> None:
    """A prefill or decode leg of a disaggregated request went out (traced: its traceparent joins `headers`)."""
    uid = headers.get(REQUEST_ID_HEADER)
    if uid is not None and role in _SENT:
        timeline.mark(uid, _SENT[role])
        if (spans := spans_of(timeline)) is not None:
            headers.update(spans.headers(uid, LEG_SPAN[role]))


def leg_answered(timeline: Timeline, role: str, headers: dict[str, str]) -> None:
    """A leg's answer (prefill: the first token) or a streamed leg's first chunk (decode) came back."""
    uid = headers.get(REQUEST_ID_HEADER)
    if uid is not None and role in _SENT:
        timeline.mark(uid, PREFILL_ANSWERED if role == "prefill" else DECODE_FIRST)
