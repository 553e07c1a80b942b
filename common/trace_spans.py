"""A request's spans, drawn from its timeline (common/timeline.py): the phases a process marks start and end
them, at the times the timeline records, so traces and timelines never disagree.

Each process has a root span per request (`proxy.request`, `prefill.request`, `decode.request`: the HTTP
request, from common/trace_asgi.py) and under it the spans of `SPANS`, each from one phase to another:

    proxy.request                 the client's request (parent: the client's traceparent, if it sent one)
      proxy.route                 the request taken in -> its first leg sent (workers picked, legs built)
      proxy.prefill_leg           prefill leg sent -> its answer (the first token)
        prefill.request           the prefill worker's HTTP request (parent: the leg's traceparent header)
          prefill.queue           arrived -> admitted to the engine
          prefill.prefill         admitted -> KV published
          prefill.published       published -> a decode worker's lookup found the blocks
      proxy.decode_leg            decode leg sent -> the answer's end
        decode.request
          decode.admission        arrived -> blocks allocated
          decode.pull             the pull registered -> the KV is in our blocks
            prefill.push          the push into decode's blocks (parent: the lookup's traceparent)
          decode.pull_report      the KV arrived -> the engine knows
          decode.first_step       -> the first step that runs the request
          decode.stream           -> the last byte of the answer

Spans start live (so a leg's or a lookup's traceparent can name them) and end when their end phase is
marked; a span whose end never comes is ended with the request (`error` attribute set).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, StatusCode

from common import timeline as tl
from common.tracing import Tracing, context_from, export_span_counts, headers

REQUEST = "request"       # a worker's pseudo-phase: the HTTP request arrived (the root span starts)
RESPONDED = "responded"   # a worker's pseudo-phase: the last byte of its answer went out (the root span ends)

# source -> span name -> (start phase, end phase or phases: the first of them ends it); the timeline's phases.
SPANS: dict[str, dict[str, tuple[str, str | tuple[str, ...]]]] = {
    tl.PROXY: {"route": (tl.RECEIVED, (tl.PREFILL_SENT, tl.DECODE_SENT)),
               "prefill_leg": (tl.PREFILL_SENT, tl.PREFILL_ANSWERED), "decode_leg": (tl.DECODE_SENT, tl.DONE)},
    tl.PREFILL: {"queue": (REQUEST, tl.ADMITTED), "prefill": (tl.ADMITTED, tl.PUBLISHED),
                 "published": (tl.PUBLISHED, tl.PUSH_STARTED), "push": (tl.PUSH_STARTED, tl.PUSH_DONE)},
    tl.DECODE: {"admission": (REQUEST, tl.ADMITTED), "pull": (tl.PULL_STARTED, tl.LOOKUP_ANSWERED),
                "pull_report": (tl.LOOKUP_ANSWERED, tl.PULL_REPORTED),
                "first_step": (tl.PULL_REPORTED, tl.FIRST_STEP), "stream": (tl.FIRST_STEP, RESPONDED)},
}
# The phase after which a process is done with a request: its open spans end there and it is forgotten.
LAST = {tl.PROXY: tl.DONE, tl.PREFILL: tl.RELEASED, tl.DECODE: RESPONDED}
LEG_SPAN = {"prefill": "prefill_leg", "decode": "decode_leg"}   # the proxy's span of a leg to a role
LOOKUP_SPAN = "pull"      # the decode span whose context the lookup carries to the prefill worker
PUSH_SPAN = "push"        # the prefill span parented by it


def _ns(at: float) -> int:
    return int(at * 1e9)


@dataclass
class _Request:
    parent: Context | None = None                          # the root span's context here
    remote: dict[str, Context] = field(default_factory=dict)  # span name -> a parent from another process
    spans: dict[str, Span] = field(default_factory=dict)   # the open ones
    error: str | None = None


class PhaseSpans:
    """Turns one process's timeline phases into spans (a timeline listener: `Timeline.listener`).

    `http=False`: a process that does not see the request's HTTP (NeuronConnector inside `vllm serve`):
    no spans from or to REQUEST and RESPONDED; a decode request is done here at its first step."""

    def __init__(self, tracing: Tracing, source: str, capacity: int = 1024, http: bool = True) -> None:
        self.tracing = tracing
        self.source = source
        self._table = {name: (start, (end,) if isinstance(end, str) else end)
                       for name, (start, end) in SPANS[source].items()
                       if http or not {start, end} & {REQUEST, RESPONDED}}
        self._last = LAST[source] if http or source != tl.DECODE else tl.FIRST_STEP
        self._capacity = capacity
        self._requests: OrderedDict[str, _Request] = OrderedDict()
        self._lock = threading.Lock()

    def begin(self, uid: str, root: Span, at: float) -> None:
        """The request's root span here; the spans starting at REQUEST start at `at`."""
        with self._lock:
            self._request(uid).parent = trace.set_span_in_context(root)
        self.phase(uid, REQUEST, at)

    def adopt(self, uid: str, traceparent: str | None) -> None:
        """`uid`'s spans here go under the span `traceparent` names (no root span of ours)."""
        if traceparent:
            with self._lock:
                self._request(uid).parent = context_from({"traceparent": traceparent})

    def join(self, uid: str, span: str, traceparent: str | None) -> None:
        """`span` of `uid` has its parent in another process, named by `traceparent`."""
        if traceparent:
            with self._lock:
                self._request(uid).remote[span] = context_from({"traceparent": traceparent})

    def headers(self, uid: str, span: str) -> dict[str, str]:
        """The traceparent header naming `span` of `uid` (empty if it is not open)."""
        with self._lock:
            request = self._requests.get(uid)
            opened = request.spans.get(span) if request is not None else None
        return {} if opened is None else headers(trace.set_span_in_context(opened))

    def fail(self, uid: str, error: str) -> None:
        with self._lock:
            if (request := self._requests.get(uid)) is not None and request.error is None:
                request.error = error

    def phase(self, uid: str, phase: str, at: float) -> None:
        """`phase` of `uid` happened at `at` (time.time()): the spans it ends end, those it starts start."""
        with self._lock:
            request = self._requests.get(uid) if phase != REQUEST else self._request(uid)
            if request is None:
                if not any(start == phase for start, _ in self._table.values()):
                    return
                request = self._request(uid)
            ending = [(name, request.spans.pop(name)) for name, (_, ends) in self._table.items()
                      if phase in ends and name in request.spans]
            starting = [name for name, (start, _) in self._table.items() if start == phase]
            for name in starting:
                parent = request.remote.get(name, request.parent)
                request.spans[name] = self.tracing.tracer.start_span(f"{self.source}.{name}", context=parent,
                                                                     start_time=_ns(at))
            # A request that failed here is done when its answer is (a prefill leg that never published).
            last = phase == self._last or (phase == RESPONDED and request.error is not None)
            if last:
                ending += list(request.spans.items())
                request.spans.clear()
                del self._requests[uid]
            error = request.error
        for name, span in ending:
            if error is not None or (last and phase not in self._table[name][1]):
                span.set_status(StatusCode.ERROR, error or f"ended at {phase}")
            span.end(end_time=_ns(at))

    def _request(self, uid: str) -> _Request:
        request = self._requests.get(uid)
        if request is None:
            # The proxy marks its phases in the request's own task: the span current there is its root.
            current = trace.get_current_span()
            parent = trace.set_span_in_context(current) if current.get_span_context().is_valid else None
            request = self._requests[uid] = _Request(parent)
            while len(self._requests) > self._capacity:
                _, dropped = self._requests.popitem(last=False)
                for span in dropped.spans.values():
                    span.set_status(StatusCode.ERROR, "the request was forgotten before this span ended")
                    span.end()
        return request


def attach(tracing: Tracing | None, timeline: tl.Timeline | None, http: bool = True) -> PhaseSpans | None:
    """Traces `timeline`'s requests (once; None when tracing is off or there is no timeline). Its registry
    shows the span counters either way (0 with tracing off)."""
    if timeline is not None:
        export_span_counts(timeline.registry, tracing)
    if tracing is None or timeline is None:
        return None
    if not isinstance(timeline.listener, PhaseSpans):
        timeline.listener = PhaseSpans(tracing, timeline.source, http=http)
    return timeline.listener


def spans_of(timeline: tl.Timeline | None) -> PhaseSpans | None:
    """The phase spans of a traced timeline, None if it is not traced."""
    listener = timeline.listener if timeline is not None else None
    return listener if isinstance(listener, PhaseSpans) else None
